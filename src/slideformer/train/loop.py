"""The training loop: data in a seeded order, optimizer steps through the engine, logs, checkpoints.

Resume restores the engine's full state and the data position (epoch and offset into that epoch's
seeded permutation), so a resumed run takes exactly the steps the uninterrupted run would have.
SIGINT (Ctrl-C) and SIGTERM: see signals.py (the step finishes, a checkpoint is saved, the run ends).
What the run may touch in ``output_dir`` is decided by train/outdir.py.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import itertools
import json
import os
import math
import re
import resource
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

from .. import EngineConfig, SlideEngine, heap, lr_at, parallel
from ..config import ConfigError, Placement
from ..data import NOT_JSON, DataError, detect_format, pack_batch, pad_batch, read_records, render, to_messages
from ..data.formats import (chat_template_text, check_chat_template, data_read, fingerprint, max_token_chars,
                            renamed, template_probe)
from ..data.lazy import LazyExamples, Subset
from ..signals import Signals, past_hangup, undoable
from ..checkpoint.export import NonFiniteStateError
from ..checkpoint.state import (STATE_DIR, CheckpointWriteError, CorruptCheckpointError, read_meta,
                                saved_state_format)
from .config import OffloadConfig, TrainConfig, _assets
from .outdir import CKPT_PREFIX, METRICS, PLOT, OutputDir, OutputDirError
from ..watchdog import GUARD_FRACTION, SAVE_LIMIT_S, MemoryGuard, Watchdog
from ..plan import DoesNotFit
from .trackers import Trackers, preflight, run_meta

# A run whose every step for this long comes out non-finite has diverged: skipping more cannot help.
MAX_DROPPED_IN_A_ROW = 10
DEFAULT_CUTOFF_LEN = 1024
VAL_SPLIT_SEED = 7919  # val_size's choice of held-out samples



class HostMemoryExceeded(MemoryError):
    """Resident memory neared the host budget: the run saved and stopped (watchdog.MemoryGuard)."""


class NonFiniteLoss(FloatingPointError):
    """The loss or gradient norm became NaN or infinite; nothing after the last checkpoint is saved."""


def _tokenizer_folder(cfg: TrainConfig):
    return _assets() / "tiny" if cfg.model_name_or_path == "tiny" else cfg.model_name_or_path


def load_tokenizer(cfg: TrainConfig):
    from transformers import AutoTokenizer

    path = _tokenizer_folder(cfg)
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"model_name_or_path {path}: cannot load its tokenizer ({str(e).splitlines()[0][:200]}); "
                          "the folder needs tokenizer.json or the tokenizer files transformers saves") from e
    if cfg.chat_template:
        tok.chat_template = chat_template_text(cfg.chat_template)
    if isinstance(tok.chat_template, str):
        check_chat_template(tok.chat_template, _template_name(cfg))
    if tok.eos_token_id is None:  # (a text sample ends with it; rows are padded with it where no pad token is set)
        raise ConfigError(f"model_name_or_path {path}: its tokenizer has no eos_token; set eos_token in its "
                          "tokenizer_config.json to the model's end-of-text token")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def eos_note(cfg: TrainConfig, tok, hf_config) -> str | None:
    """What the start says where the tokenizer's eos (which ends every text and prompt/completion sample) is
    not the model's end of text (config.json's or generation_config.json's eos_token_id): a model trained so
    learns to end with a token its generation does not stop on (a GGUF conversion's tokenizer often says
    another); None where it is one of them, or the model names none."""
    ids = hf_config.get_text_config().eos_token_id
    ids = set(ids if isinstance(ids, (list, tuple)) else [] if ids is None else [ids])
    generation = Path(_tokenizer_folder(cfg)) / "generation_config.json"
    try:
        more = json.loads(generation.read_text()).get("eos_token_id") if generation.is_file() else None
    except (OSError, ValueError, AttributeError):
        more = None
    ids |= set(more if isinstance(more, list) else [] if more is None else [more])
    ids = {i for i in ids if isinstance(i, int)}
    if not ids or tok.eos_token_id in ids:
        return None
    theirs = ", ".join(f"{tok.convert_ids_to_tokens(i)!r} (id {i})" for i in sorted(ids))
    return (f"the tokenizer's eos_token {tok.eos_token!r} (id {tok.eos_token_id}) is not the model's end of text, "
            f"{theirs} (config.json, generation_config.json): text and prompt/completion samples end with the "
            "tokenizer's, which generation does not stop on; set eos_token in "
            f"{_tokenizer_folder(cfg)}/tokenizer_config.json to the model's")


def vocab_limit(cfg: TrainConfig, tok, hf_config) -> int | None:
    """The model's vocabulary where the tokenizer holds ids past it (added tokens, the embeddings not
    resized): each sample is then checked (make_sample); None where it holds none. A pad token past it is
    refused now, as padding is no record's."""
    vocab = hf_config.get_text_config().vocab_size
    if tok.pad_token_id is not None and tok.pad_token_id >= vocab:
        raise ConfigError(f"the tokenizer of {cfg.model_name_or_path} pads with {tok.pad_token!r}, id "
                          f"{tok.pad_token_id}, past the model's vocabulary of {vocab} (its config.json): resize the "
                          "model's embeddings to the tokenizer, or give it a pad token the model has")
    return vocab if max(tok.get_vocab().values(), default=-1) >= vocab else None


def _template_name(cfg: TrainConfig) -> str:
    """The chat template as a message names it: the config's (a file's path, or inline), or the model's."""
    if cfg.chat_template:
        named = "{{" not in cfg.chat_template and "{%" not in cfg.chat_template  # (a file's path)
        return f"chat_template {cfg.chat_template}" if named else "chat_template"
    return f"the chat template of {_tokenizer_folder(cfg)}"


def template_report(cfg: TrainConfig, tok) -> tuple[str | None, str | None]:
    """The tokenizer's chat template probed (data/formats.py ``template_probe``): the refusal the first chat
    record meets, and the note the run's start says."""
    return template_probe(tok, _template_name(cfg)) if isinstance(tok.chat_template, str) else (None, None)


def make_sample(cfg: TrainConfig, tok, token_chars: int, vocab: int | None, refusal: str | None, spec, where: str,
                rec: dict):
    """One record's sample: (ids, labels) truncated to cutoff_len and whether it was, or None where no token
    within cutoff_len is a target; DataError where the record is malformed, ConfigError where the tokenizer
    gives an id past the model's ``vocab`` (vocab_limit; whatever the record: skip_bad_records does not pass
    it over) or the chat template renders no content (``refusal``, template_report's: at the first chat record,
    which data without any never meets)."""
    rec = renamed(rec, spec.columns, where)
    fmt = detect_format(rec, where) if spec.format == "auto" else spec.format
    msgs = to_messages(rec, fmt, where)
    if isinstance(msgs, list) and tok.chat_template is None:
        raise ConfigError(f"{where}: {fmt} data needs a chat template, and the tokenizer has none; "
                          "set chat_template in the config")
    if isinstance(msgs, list) and refusal:
        raise ConfigError(refusal)
    ids, labels = render(msgs, tok, where, cfg.cutoff_len, token_chars)
    truncated = len(ids) > cfg.cutoff_len
    ids, labels = ids[: cfg.cutoff_len], labels[: cfg.cutoff_len]
    if vocab is not None and ids and (top := max(ids)) >= vocab:
        raise ConfigError(f"{where}: the tokenizer of {cfg.model_name_or_path} gives token id {top} "
                          f"({tok.convert_ids_to_tokens(top)!r}), past the model's vocabulary of {vocab} (its "
                          f"config.json): the tokenizer holds {len(tok)} tokens; resize the model's embeddings to "
                          "them, or train with the tokenizer the model was made with")
    return (ids, labels, truncated) if any(l != -100 for l in labels[1:]) else None


def build_examples(cfg: TrainConfig, tok, vocab: int | None, specs=None, lazy: bool = False):
    """The samples of ``specs`` (default: the dataset) by record, None for a record that is no sample; the
    number of records skipped as malformed, the number dropped for having no target token within cutoff_len,
    and the number of samples cut at cutoff_len: tokenized up front (a list), or with ``lazy`` a LazyExamples
    (data/lazy.py: each made when a step reaches it, its counts growing as records are met; the numbers
    returned are then 0). Both are indexed by record, so the seeded order over them is the same either way."""
    from ..data.lazy import open_records

    specs = specs or cfg.dataset
    key = "dataset" if specs is cfg.dataset else "eval_dataset"
    _read_once(specs, key)
    if key == "dataset" and cfg.eval_dataset:  # (before the training data is tokenized: refused at once)
        _evaluated_apart(cfg)
    make = functools.partial(make_sample, cfg, tok, max_token_chars(tok), vocab, template_report(cfg, tok)[0])
    def read(reader, spec):  # (eval_dataset's file named as its key's; max_samples: the first records)
        try:
            records = reader(spec.path, skip_bad=cfg.skip_bad_records, split=spec.split, subset=spec.subset)
        except DataError as e:
            if key == "dataset":
                raise
            raise DataError(f"{key}: {e}") from None
        if cfg.max_samples is None or len(records) <= cfg.max_samples:
            return records
        return records[: cfg.max_samples] if isinstance(records, list) else Subset(records, range(cfg.max_samples))

    if lazy:
        sources = []
        for spec in specs:
            records = read(open_records, spec)
            if not len(records):
                raise DataError(f"{key} file {spec.path} holds no records")
            sources.append((records, spec))
        _listed_alike([(_first(records), spec) for records, spec in sources], key)
        return LazyExamples(sources, make, cfg.skip_bad_records), 0, 0, 0
    examples, skipped, dropped, truncated, firsts = [], 0, 0, 0, []
    for spec in specs:  # (a file at a time: its records go once tokenized)
        records = read(read_records, spec)
        if not records:
            raise DataError(f"{key} file {spec.path} holds no records")
        firsts.append((_first(records), spec))
        for where, rec in records:  # (a record that is no sample keeps its place, as None: the order is the records')
            made = None
            if rec is NOT_JSON:  # a line that is not JSON, skipped (skip_bad_records)
                skipped += 1
            else:
                try:
                    made = make(spec, where, rec)
                except DataError:
                    if not cfg.skip_bad_records:
                        raise
                    skipped += 1
                else:
                    dropped += made is None
                    truncated += made is not None and made[2]
            examples.append(None if made is None else made[:2])
    _listed_alike(firsts, key)
    if specs is cfg.dataset and skipped + dropped == len(examples):  # (held-out data: evaluation says so)
        raise _none_trainable(cfg, skipped, dropped)
    return examples, skipped, dropped, truncated


def _read_once(specs, key: str) -> None:
    """Two entries that read the same records alike (a folder and a file in it, one file by two names, a
    save_to_disk folder and its split) are refused: each record would count twice, unsaid (the config
    refuses one spelling twice)."""
    seen = {}
    for spec in specs:
        how = (spec.format, tuple(sorted((spec.columns or {}).items())))  # (read another way: other data)
        for item in data_read(spec.path, spec.split, spec.subset):
            if (first := seen.setdefault((item, how), spec)) is not spec:
                raise DataError(f"{key} lists {first.path} and {spec.path}, which both read {_named(item)}: its "
                                "records would count twice; list it once")


def _named(item: tuple) -> str:
    """A data_read item as a message names it."""
    return item[0] + (f" (split {item[1]})" if len(item) > 1 and item[1] else "")


def _evaluated_apart(cfg: TrainConfig) -> None:
    """eval_dataset reading what dataset trains on is refused: the held-out loss would be of training
    samples (a save_to_disk folder's split defaults to train for both)."""
    trained = {item for spec in cfg.dataset for item in data_read(spec.path, spec.split, spec.subset)}
    for spec in cfg.eval_dataset:
        if both := sorted(data_read(spec.path, spec.split, spec.subset) & trained):
            raise DataError(f"eval_dataset {spec.path} reads {_named(both[0])}, which dataset trains on: the "
                            "evaluation would be of training samples; give held-out data (another file, or a "
                            "split: test), or set val_size instead")


def _first(records, most: int = 16) -> list:
    """The first (where, record) pairs of ``records`` that are records (objects), of the first ``most``: what
    auto reads a file as (_listed_alike)."""
    return [(w, r) for w, r in (records[i] for i in range(min(most, len(records)))) if isinstance(r, dict)]


def _listed_alike(sources, key: str) -> None:
    """A file listed twice, once with format auto and once with the format auto finds in it (in each of its
    first records: ``sources`` pairs each listing's first records with it), is read alike: its records would
    count twice (the config refuses the same spelling twice)."""
    from ..data.formats import detect_format

    by_file: dict = {}
    for records, spec in sources:
        path = os.fspath(spec.path)
        same = (os.path.realpath(path) if os.path.exists(path) else path, spec.split, spec.subset,
                tuple(sorted((spec.columns or {}).items())))
        by_file.setdefault(same, []).append((records, spec))
    for listed in by_file.values():
        auto = next(((r, s) for r, s in listed if s.format == "auto"), None)
        if auto is None or len(listed) < 2 or not len(auto[0]):
            continue
        try:
            kinds = {detect_format(renamed(rec, auto[1].columns, where), where) for where, rec in auto[0]}
        except DataError:  # (a record that tells nothing: read as it comes)
            continue
        if len(kinds) > 1:  # (a file of mixed formats: auto reads each record its own way)
            continue
        (found,) = kinds
        if (other := next((s for _, s in listed if s.format == found), None)) is not None:
            raise DataError(f"{key} lists {auto[1].path} twice, read alike: format auto reads it as {found}, as "
                            f"its listing as {other.path} (format: {found}) does; its records would count twice; "
                            "list it once")


def _none_trainable(cfg: TrainConfig, skipped: int, dropped: int) -> DataError:
    """No record is a sample: the counts, and the config's own template where it may be why."""
    why = "; a chat_template that does not render the assistant turns' content leaves none either" \
        if dropped and cfg.chat_template else ""
    return DataError(f"no trainable examples: {skipped} record(s) skipped as malformed, {dropped} with no target "
                     f"token within cutoff_len {cfg.cutoff_len}{why}")


def held_out(cfg: TrainConfig, tok, vocab: int | None, examples, in_ram=lambda specs: False):
    """Training's samples and evaluation's: eval_dataset's (read up front where ``in_ram(specs)``), or
    val_size of the dataset's records, the same ones whatever the seed (runs that differ in seed are
    evaluated on the same samples); with eval_dataset's records skipped and dropped."""
    if cfg.eval_dataset:
        held, h_skipped, h_dropped, _ = build_examples(cfg, tok, vocab, cfg.eval_dataset,
                                                       lazy=not in_ram(cfg.eval_dataset))
        return examples, held, (h_skipped, h_dropped)
    if not cfg.val_size:
        return examples, [], (0, 0)
    k = max(1, round(cfg.val_size * len(examples)))
    if k >= len(examples):
        raise DataError(f"val_size {cfg.val_size} of {len(examples)} records leaves none to train on")
    pick = torch.randperm(len(examples), generator=torch.Generator().manual_seed(VAL_SPLIT_SEED)).numpy()
    part = (lambda ix: [examples[i] for i in ix]) if isinstance(examples, list) else \
        (lambda ix: Subset(examples, ix))  # (read as reached: a view)
    return part(np.sort(pick[k:])), part(np.sort(pick[:k])), (0, 0)


def resolve_engine(cfg: TrainConfig, hf_config, ecfg: EngineConfig, examples, machine, held=()) -> EngineConfig:
    """``ecfg`` with the config's "auto" settings decided by the planner (plan.resolve) for this step's
    shape on ``machine`` (its rows as long as the longest training or ``held``-out sample: an evaluation's
    micro-batch runs in the same window); refused before anything is allocated where it does not fit."""
    from ..model import ModelAdapter
    from ..plan import Auto, ModelShape, resolve

    shape = ModelShape.from_adapter(ModelAdapter(hf_config, ecfg.compute_dtype, ecfg.attn_implementation))
    # packed rows are full; samples read as the steps reach them may be as long as cutoff_len
    seq = cfg.cutoff_len if cfg.packing or not all(isinstance(x, (list, tuple)) for x in (examples, held)) else \
        min(cfg.cutoff_len, max(len(e[0]) for x in (examples, held) for e in x if e is not None))
    auto, _ = Auto.of(_asked(cfg.offload))
    plan = resolve(ecfg, auto, shape, cfg.micro_batch_size * cfg.gradient_accumulation_steps, seq, machine,
                   micro_batch=cfg.micro_batch_size, prefix="offload.")
    if not plan.fits:
        raise DoesNotFit(plan.problem)
    return plan.config


def load_model_config(cfg: TrainConfig):
    """The model's Hugging Face config, checked before anything heavy: a local folder that transformers
    reads, a family the engine splits into units, positions for cutoff_len."""
    from ..model import ModelAdapter
    from ..presets import preset_config

    if cfg.model_name_or_path == "tiny":
        hf_config = preset_config("tiny")
    else:
        from transformers import AutoConfig

        path = Path(cfg.model_name_or_path)
        hub = "; slideformer reads local folders (fetch one with `hf download ORG/NAME --local-dir DIR`)"
        if not path.exists():
            raise ConfigError(f"model_name_or_path {path}: no such folder{hub}")
        if not path.is_dir():
            raise ConfigError(f"model_name_or_path {path} is a file; give the folder that holds config.json and "
                              "the safetensors weights")
        if not (path / "config.json").is_file():
            raise ConfigError(f"model_name_or_path {path} has no config.json: not a Hugging Face model folder")
        try:
            hf_config = AutoConfig.from_pretrained(str(path))
        except Exception as e:  # (whatever transformers makes of a config.json: its content is the user's)
            raise ConfigError(f"{path / 'config.json'}: transformers cannot read it "
                              f"({' '.join(str(e).split())[:240]})") from e
    try:  # (what the engine cannot run: refused now)
        ModelAdapter(hf_config, attn_implementation=cfg.attn_implementation)
    except ImportError as e:  # (transformers' check of the attention's package)
        raise ConfigError(f"attn_implementation={cfg.attn_implementation!r}: {str(e).splitlines()[0][:200]}; install "
                          "it, or leave attn_implementation unset (sdpa)") from None
    positions = getattr(hf_config, "max_position_embeddings", None)
    if cfg.cutoff_len is None:
        cfg.cutoff_len = min(DEFAULT_CUTOFF_LEN, positions or DEFAULT_CUTOFF_LEN)
    if positions is not None and cfg.cutoff_len > positions:
        raise ConfigError(f"cutoff_len {cfg.cutoff_len} exceeds the model's max_position_embeddings {positions}; "
                          f"set cutoff_len <= {positions}")
    return hf_config


def _in_user_keys(message: str) -> str:
    """An EngineConfig message in the trainer's key names (offload.window_slots, learning_rate)."""
    from .config import OffloadConfig

    names = sorted((f.name for f in dataclasses.fields(OffloadConfig)), key=len, reverse=True)
    message = message.replace("compute_dtype=torch.bfloat16", "bf16: true")
    message = re.sub(r"(?<![\w.])(" + "|".join(names) + r")\b", r"offload.\1", message)
    return re.sub(r"(?<![\w.])lr\b", "learning_rate", message)


def _asked(o: OffloadConfig) -> dict:
    """The offload section's placement keys, by name."""
    return {f.name: getattr(o, f.name) for f in dataclasses.fields(Placement) if hasattr(o, f.name)}


def _placement(o: OffloadConfig) -> Placement:
    """What is "auto" keeps the engine's default until the planner decides it (resolve_engine)."""
    from ..plan import Auto

    return Placement(**Auto.of(_asked(o))[1])


def train(cfg: TrainConfig) -> dict:
    # (a signal before training starts raises here, so the run leaves its folder as it found it: torch is
    # imported by now; until then the command's handler ends the process at once, signals.py)
    with Signals() as signals, undoable():
        try:
            result = _train(cfg, signals)
        except parallel.RankLost:
            raise  # (no teardown: NCCL's can hang on a lost peer's communicator; the process exits anyway)
        except BaseException:
            parallel.leave()
            raise
        parallel.leave()
        return result


def _train(cfg: TrainConfig, signals: Signals) -> dict:
    device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device: cuda, but this torch ({torch.__version__}) sees no CUDA GPU; set device: cpu, "
                          "or leave device unset to use a GPU where there is one")
    if cfg.fp8 and device != "cuda":
        raise ConfigError(f"fp8: true multiplies on a GPU's FP8 tensor cores (Hopper or newer); on device {device} it "
                          "would only emulate them, slower than without: set fp8: false")
    bf16 = cfg.bf16 if cfg.bf16 is not None else device == "cuda"
    if device == "cuda" and int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun: one GPU a process
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    ranks = parallel.init_from_env(device)  # (under torchrun: data parallel, parallel.py)
    o = cfg.offload
    ecfg = EngineConfig(lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon,
                        weight_decay=cfg.weight_decay,
                        max_grad_norm=cfg.max_grad_norm, device=device, seed=cfg.seed,
                        compute_dtype=torch.bfloat16 if bf16 else torch.float32,
                        gpu_memory_limit=o.gpu_memory_limit, host_memory_limit=o.host_memory_limit,
                        optimizer_state=o.optimizer_state, attn_implementation=cfg.attn_implementation,
                        fp8=cfg.fp8, offload_dir=o.offload_dir, placement=_placement(o))
    try:
        ecfg.validate()  # (before any work; its messages in the config's key names)
    except ConfigError as e:
        raise ConfigError(_in_user_keys(str(e))) from None
    from ..machine import Machine, host_memory
    from ..plan.memory import check_host_limit

    check_host_limit(o.host_memory_limit, host_memory(), "offload.host_memory_limit")
    hf_config = load_model_config(cfg)
    resume = cfg.resume_from_checkpoint
    # (a folder that is not a checkpoint is refused before any work)
    meta = _given_checkpoint(resume) if resume not in (None, "auto") else None
    out = OutputDir.check(cfg.output_dir, resume=resume, overwrite=cfg.overwrite_output_dir,
                          resume_run=meta["trainer"].get("run_id") if meta is not None else None)
    inputs = [("model_name_or_path", cfg.model_name_or_path)] * (cfg.model_name_or_path != "tiny") + \
        [(key, d.path) for key in ("dataset", "eval_dataset") for d in getattr(cfg, key) or ()] + \
        [("chat_template", cfg.chat_template)] * bool(cfg.chat_template and "{{" not in cfg.chat_template
                                                      and "{%" not in cfg.chat_template)
    for key, path in inputs:  # (read by this run, and in what it writes over or rotates away)
        if name := out.holds(path):
            raise OutputDirError(f"{key} {path} lies in {name} of output_dir {out.path}, which this run writes, "
                                 "replaces or rotates away: move it out of that folder, or choose another output_dir")
    # (a path only: auto takes the newest intact one)
    if meta is not None and (later := out.checkpoints_after(meta["trainer"]["step"])):
        raise OutputDirError(f"output_dir {out.path} holds this run's {later[-1].name}, past {resume}: training on "
                             "from there would leave two histories in one folder (and resume_from_checkpoint: auto "
                             "would go back to the later one); resume the newest, move the later checkpoints away, or "
                             "train into another output_dir")
    if o.offload_dir:
        _check_writable(o.offload_dir, "offload.offload_dir")
    if ranks is None:
        out.open()  # (from here the folder is the run's: locked; marked, or at its first write: OutputDir.begin)
    else:  # rank 0 takes the folder; the others write only their checkpoint files into it, under its run id
        out.run_id = parallel.from_leader(lambda: out.open().run_id)
    lead = ranks is None or ranks.leader
    try:
        resume = _resume_point(cfg, out, ranks, resume)  # (before the data: a refusal costs no tokenizing)
        if resume and (was := saved_state_format(resume)) and was != o.optimizer_state:
            raise ConfigError(f"{resume} was saved with offload.optimizer_state: {was}, this run has "
                              f"{o.optimizer_state}: resume it with offload.optimizer_state: {was} (a run keeps its "
                              "state's format; for another, start a new run from the checkpoint's weights, into "
                              "another output_dir: model_name_or_path: the checkpoint, resume_from_checkpoint: null)")
        if lead:  # (a tracker that cannot open: refused before the model loads)
            preflight(cfg.report_to, out.path)
        tok = load_tokenizer(cfg)
        for note in (template_report(cfg, tok)[1], eos_note(cfg, tok, hf_config)):
            if note and (ranks is None or ranks.leader):
                print(f"slideformer: {note}", file=sys.stderr, flush=True)
        examples, skipped, dropped, held, total, warmup = _training_data(cfg, tok, hf_config, ecfg, ranks)
        machine = Machine.detect(device)
        if o.offload_dir:  # (the tier is planned within the disk's free space, once what ended runs left is gone)
            free = functools.partial(_tier_disk, o.offload_dir)  # (rank 0's: one plan for every rank)
            machine = dataclasses.replace(machine, disk=free() if ranks is None else parallel.from_leader(free))
        ecfg = resolve_engine(cfg, hf_config, ecfg, examples, machine, held)
        try:  # (the engine's own refusals, before it allocates, in the config's key names)
            if cfg.model_name_or_path == "tiny":
                engine = SlideEngine.from_config(hf_config, ecfg)
            else:
                engine = SlideEngine.from_pretrained(cfg.model_name_or_path, ecfg)
        except DoesNotFit as e:
            raise DoesNotFit(_in_user_keys(str(e))) from None
        with engine:
            result = _loop(cfg, signals, engine, out, resume, tok, examples, skipped, dropped, total, warmup, device,
                           held)
    finally:
        if lead:
            out.close()
    return result


def _tier_disk(offload_dir: str) -> int:
    """Bytes the NVMe tier may take under ``offload_dir``: its disk's free space, after removing the tiers
    of processes that ended (what the tier's own start would remove)."""
    from ..host.nvme import remove_stale
    from ..machine import disk_free

    if os.path.isdir(offload_dir):
        remove_stale(offload_dir)
    return disk_free(offload_dir)


# a resume's data records said as changed, not by value
CHANGED = {"content": "the dataset's content (a file edited or replaced)",
           "entries": "a dataset entry's format, split, subset or columns", "chat_template": "the chat template"}


def _given_checkpoint(path: str) -> dict:
    """The metadata of the checkpoint resume_from_checkpoint names; a path that is none said as what it is."""
    fix = "set resume_from_checkpoint to a checkpoint-N folder's path, auto (this output_dir's newest) or null"
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"resume_from_checkpoint {path}: " + ("no such folder (a link to a missing one)"
                                                               if p.is_symlink() else "no such folder") + f"; {fix}")
    if p.is_dir() and not (p / STATE_DIR).exists() and (p / "config.json").is_file():
        raise ConfigError(f"resume_from_checkpoint {path} holds a model without training state (an export, or a "
                          f"Hugging Face folder): to train from its weights, set model_name_or_path: {path} and "
                          "resume_from_checkpoint: null")
    with _earlier_if_damaged():
        return read_meta(path)


@contextlib.contextmanager
def _earlier_if_damaged():
    """A damaged checkpoint that resume_from_checkpoint names: the fix said (not for one of another model or
    optimizer_state, whose line says its own)."""
    try:
        yield
    except CorruptCheckpointError as e:
        if "another model" in str(e) or "optimizer_state" in str(e):
            raise
        raise CorruptCheckpointError(f"{e}; resume from an earlier checkpoint (moving this one away, "
                                     "resume_from_checkpoint: auto takes the newest intact one)") from None


def _resume_point(cfg: TrainConfig, out: OutputDir, ranks, resume):
    """The checkpoint this run resumes (``auto``: the newest intact one of the folder's run, or none), decided
    by rank 0; a checkpoint of a run of another model is refused under ``auto``, said for a path given."""
    lead = ranks is None or ranks.leader
    if resume == "auto":
        def latest():
            found, damaged = out.latest_intact()
            if found is None and damaged:
                raise CorruptCheckpointError(
                    f"resume_from_checkpoint: auto found no intact checkpoint of this run in {out.path} "
                    f"({len(damaged)} damaged, newest {damaged[0].name}); move them away to start over, or set "
                    "resume_from_checkpoint to a checkpoint's path")
            return (str(found) if found else None), [p.name for p in damaged]
        resume, passed_over = latest() if ranks is None else parallel.from_leader(latest)
        out.passed_over = set(passed_over)
    if resume:  # (rank 0 decides: every rank refuses alike, or trains)
        def recorded():
            return read_meta(resume)["trainer"].get("model")
        was = recorded() if ranks is None else parallel.from_leader(recorded)
        if was is not None and was != _model_id(cfg):  # (checkpoints before it was recorded: not told)
            if cfg.resume_from_checkpoint == "auto":
                raise OutputDirError(
                    f"output_dir {out.path} holds a run of model {was} (newest intact {Path(resume).name}), and "
                    f"this run names {cfg.model_name_or_path}: choose another output_dir for it, or set "
                    "overwrite_output_dir: true with resume_from_checkpoint: null to start over there; to "
                    f"continue that run (its model moved), set resume_from_checkpoint: {resume}")
            if lead:  # (a checkpoint path: the user's choice)
                print(f"slideformer: {resume} is of a run of model {was}; this run names "
                      f"{cfg.model_name_or_path}: the weights trained on are the checkpoint's", file=sys.stderr,
                      flush=True)
    return resume


def _training_data(cfg: TrainConfig, tok, hf_config, ecfg: EngineConfig, ranks):
    """The training and held-out examples (tokenized up front where they fit the process's share of RAM,
    else read as reached), the counts left out, and the steps and warmup steps they make."""
    from ..data.lazy import source_bytes
    from ..machine import host_memory
    from ..plan.memory import data_in_ram, process_allowance

    world = ranks.world if ranks else 1
    allowance = process_allowance(ecfg, host_memory()) // parallel.local_world(ranks)  # (one process's share)

    def in_ram(specs) -> bool:  # (under several ranks rank 0's choice: each rank counts the steps alike)
        fits = lambda: data_in_ram(sum(source_bytes(s.path) for s in specs), allowance)  # noqa: E731
        return fits() if ranks is None else parallel.from_leader(fits)
    vocab = vocab_limit(cfg, tok, hf_config)
    examples, skipped, dropped, truncated = build_examples(cfg, tok, vocab, lazy=not in_ram(cfg.dataset))
    if isinstance(examples, LazyExamples):
        say0 = print if ranks is None or ranks.leader else (lambda *a, **k: None)
        say0(f"slideformer: the dataset ({len(examples)} records) is read as the steps reach it, not tokenized up "
             "front: its records are checked and counted as they are met", flush=True)
        if vocab is not None:
            say0(f"slideformer: the tokenizer holds {len(tok)} tokens, past the model's vocabulary of {vocab}: a "
                 "record that gives one of those ids stops the run when a step reaches it", file=sys.stderr,
                 flush=True)
    if dropped:
        print(f"slideformer: {dropped} sample(s) have no target token within cutoff_len {cfg.cutoff_len} and are "
              "left out", file=sys.stderr)
    if truncated and (ranks is None or ranks.leader):
        print(f"slideformer: {truncated} of {len(examples) - skipped - dropped} sample(s) are longer than cutoff_len "
              f"{cfg.cutoff_len} and are cut there (their tokens past it are not trained); raise cutoff_len, or "
              "split long documents", file=sys.stderr)
    examples, held, (h_skipped, h_dropped) = held_out(cfg, tok, vocab, examples, in_ram)
    records = len(examples) + len(held)
    if cfg.val_size and len(held) > 1.5 * cfg.val_size * records and (ranks is None or ranks.leader):
        print(f"slideformer: val_size {cfg.val_size} of {records} records holds out {len(held)} "
              f"({len(held) / records:.1%} of them: at least one)", file=sys.stderr)
    if cfg.val_size and isinstance(held, list) and None in held and (ranks is None or ranks.leader):
        print(f"slideformer: val_size holds out {len(held)} records, of which {len(held) - held.count(None)} are "
              "samples (the others are malformed or have no target token within cutoff_len): the evaluation is "
              "of those", file=sys.stderr)
    if cfg.eval_dataset:
        if isinstance(held, LazyExamples):
            # (every evaluation reads it whole: its records are checked once now, not first after training)
            for i in range(len(held)):
                held[i]
        if h_skipped or h_dropped or getattr(held, "skipped", 0) or getattr(held, "dropped", 0):
            print(f"slideformer: eval_dataset: {_counts(held, h_skipped, h_dropped, whole=True)}; left out of "
                  "evaluation", file=sys.stderr)
    # an epoch's samples: those tokenized up front; read as reached, the records (those that are no sample
    # then make an epoch's last steps wrap into the next)
    samples = sum(e is not None for e in examples) if isinstance(examples, list) else len(examples)
    if not samples:
        raise DataError(f"val_size {cfg.val_size} leaves no sample to train on: {_counts(examples, skipped, dropped)}")
    if cfg.packing and cfg.max_steps <= 0 and not isinstance(examples, list):
        raise DataError("packing: the dataset is read as the steps reach it, so how many packed rows an epoch makes "
                        "is not known before training; set max_steps (num_train_epochs counts epochs of rows)")
    rows = cfg.micro_batch_size * world  # (a micro-batch's, every rank's)
    if cfg.max_steps > 0:
        total = cfg.max_steps
    else:  # the micro-batches the epochs hold as _draw takes them, whole steps of them
        mbs = _epoch_micro_batches(cfg, examples, rows)
        accumulate, lead = cfg.gradient_accumulation_steps, ranks is None or ranks.leader
        total = max(1, math.floor(mbs / accumulate + 1e-9))
        left = math.floor(mbs + 1e-9) - total * accumulate  # (the last epoch's micro-batches short of a step)
        if lead and not cfg.packing and samples % rows:
            print(f"slideformer: {samples} samples, micro-batches of {rows}: " + (
                f"the last {samples % rows} samples of each epoch's order are left out of it (other ones each epoch)"
                if samples > rows else "the dataset is smaller than one micro-batch, which takes all of it"),
                file=sys.stderr, flush=True)
        if lead and mbs < accumulate:
            print(f"slideformer: num_train_epochs {cfg.num_train_epochs} holds {mbs:g} micro-batch(es), fewer than "
                  f"a step's {accumulate}: one step is trained, its micro-batches drawn from "
                  "as many epochs as it takes (set max_steps to choose)", file=sys.stderr, flush=True)
        elif lead and left > 0:
            print(f"slideformer: num_train_epochs {cfg.num_train_epochs} holds {math.floor(mbs + 1e-9)} micro-batches, "
                  f"{total} step(s) of {accumulate}: the last {left} ({left * rows} "
                  f"{'packed rows' if cfg.packing else 'samples'}) are short of a step and not trained (max_steps: "
                  f"{total + 1} trains them, with the next epoch's first)", file=sys.stderr, flush=True)
    return examples, skipped, dropped, held, total, _warmup(cfg, total)


def _warmup(cfg, total: int) -> int:
    """The warmup steps of a run of ``total`` steps: as transformers' TrainingArguments.get_warmup_steps, but
    none for one step (the first warmup step's rate is 0, so a run of one step in warmup would train nothing)."""
    ws = cfg.warmup_ratio if cfg.warmup_steps is None else cfg.warmup_steps
    return 0 if total == 1 else int(ws) if ws >= 1 else math.ceil(ws * total)


def _epoch_micro_batches(cfg, examples, rows: int, epoch: int = 0, offset: int = 0) -> float:
    """The micro-batches of ``rows`` rows that num_train_epochs holds from ``offset`` in epoch ``epoch``'s order
    on, as _draw takes them: every epoch its whole micro-batches (at least one; packed: its samples' rows),
    the last epoch the fraction num_train_epochs gives of its own. From a resumed position (a run whose batch or
    data changed), what is left of that epoch's share."""
    epochs = cfg.num_train_epochs
    if cfg.packing:  # (epochs counted up front, at most MAX_PACKED_EPOCHS: the examples are a list)
        total = 0.0
        for k in range(epoch, math.ceil(epochs)):
            order = _permutation(len(examples), cfg.seed, k)
            held = -(-_packed_rows(examples, order, cfg.cutoff_len) // rows)
            left = -(-_packed_rows(examples, order[offset:], cfg.cutoff_len) // rows) if k == epoch else held
            total += max(0.0, min(1.0, epochs - k) * held - (held - left))
        return total
    # (every epoch the same whole micro-batches: counted at once, however many epochs)
    samples = sum(e is not None for e in examples) if isinstance(examples, list) else len(examples)
    if samples < rows:  # (each step takes an epoch whole, from the next one on: epoch 0's order is never drawn)
        return max(0.0, epochs - epoch - (0 < offset < len(examples)))
    held = samples // rows
    if not offset:
        return max(0.0, epochs - epoch) * held
    order = _permutation(len(examples), cfg.seed, epoch)
    rest = sum(examples[i] is not None for i in order[offset:]) if isinstance(examples, list) \
        else len(examples) - offset
    return max(0.0, min(1.0, epochs - epoch) * held - (held - rest // rows)) + max(0.0, epochs - epoch - 1) * held


def _loop(cfg, signals, engine, out: OutputDir, resume, tok, examples, skipped, dropped, total, warmup,
          device, held=()) -> dict:
    """Resume (the engine's state and the data position), then train to ``total`` steps, logging and saving.
    Under several ranks (parallel.py) every rank draws the same global micro-batches, of micro_batch_size
    rows for each rank, and trains its rows of each; rank 0 alone prints, logs and rotates checkpoints."""
    ranks = engine.ranks
    world, lead = (ranks.world, ranks.leader) if ranks else (1, True)
    say = print if lead else (lambda *a, **k: None)
    say(f"slideformer: {engine.describe()}" + (f" (rank 0 of {world})" if ranks else ""), flush=True)
    start, epoch, offset, eval_pending = 0, 0, 0, False
    # what decides the data each step draws: the same on resume, or the data from there is another run's
    model = _model_id(cfg)  # (recorded: a resume naming another model is refused or said, _train)
    data = {"seed": cfg.seed, "batch": cfg.micro_batch_size * cfg.gradient_accumulation_steps * world,
            "samples": len(examples), "dataset": [_where(d.path) for d in cfg.dataset], "packing": cfg.packing,
            "max_samples": cfg.max_samples,
            "cutoff_len": cfg.cutoff_len, "val_size": cfg.val_size,
            # (what a resume says changed in brief, CHANGED)
            "content": [fingerprint(d.path) for d in cfg.dataset] if ranks is None else  # (rank 0's reads)
            parallel.from_leader(lambda: [fingerprint(d.path) for d in cfg.dataset]),
            "entries": [[d.format, d.split, d.subset, d.columns] for d in cfg.dataset],
            "chat_template": hashlib.blake2b(tok.chat_template.encode(), digest_size=16).hexdigest()
            if isinstance(tok.chat_template, str) else None}
    # what decides each step's update (the config's keys, and the steps max_steps or num_train_epochs give): a
    # resume that changes one says so
    update = {"learning_rate": cfg.learning_rate, "lr_scheduler_type": cfg.lr_scheduler_type,
              "steps": total, "warmup_steps": warmup,  # (the steps warmup_ratio or warmup_steps gives)
              "weight_decay": cfg.weight_decay, "adam_beta1": cfg.adam_beta1, "adam_beta2": cfg.adam_beta2,
              "adam_epsilon": cfg.adam_epsilon,
              "max_grad_norm": cfg.max_grad_norm,
              "bf16": engine.cfg.compute_dtype == torch.bfloat16, "fp8": cfg.fp8}
    if resume:
        with _earlier_if_damaged() if cfg.resume_from_checkpoint != "auto" else contextlib.nullcontext():
            state = engine.load_checkpoint(resume)
        start, epoch, offset = state["step"], state["epoch"], state["offset"]
        say(f"slideformer: resumed from {resume} at step {start}", flush=True)

        def differ(now: dict, key: str) -> list[str]:  # (the keys of ``now`` the checkpoint recorded otherwise)
            was = state.get(key) or {}
            return [k for k in now if k in was and was[k] != now[k]]

        def said(now: dict, key: str, keys: list[str]) -> str:
            return ", ".join(CHANGED[k] if k in CHANGED else f"{k} {now[k]} (it was {state[key][k]})" for k in keys)

        if changed := differ(data, "data"):
            say(f"slideformer: resumed with {said(data, 'data', changed)}: the data from step {start + 1} on is not "
                f"what the interrupted run would have drawn (its position, {offset} samples into epoch {epoch}, is "
                "kept)", file=sys.stderr, flush=True)
            if cfg.max_steps <= 0 and set(changed) - set(CHANGED):  # (the epochs' steps, from the position kept)
                total = start + math.floor(_epoch_micro_batches(cfg, examples, cfg.micro_batch_size * world, epoch,
                                                                offset) / cfg.gradient_accumulation_steps + 1e-9)
                warmup = _warmup(cfg, total)
                update.update(steps=total, warmup_steps=warmup)
        # (at its end nothing follows them; the end num_train_epochs moved there at this batch is said)
        if (changed := differ(update, "update")) and (start < total or cfg.max_steps <= 0 and "steps" in changed):
            say(f"slideformer: resumed with {said(update, 'update', changed)}: the steps from {start + 1} on follow "
                "these, not the interrupted run's settings", file=sys.stderr, flush=True)
        # (the run saved at an evaluation's step before it, or this run ends there (a lower max_steps): pending
        # unless its record made it to metrics.jsonl, where a kill or a failure during it would have kept it from)
        done = lambda: out.begun and any(  # noqa: E731  (the folder's metrics: this run's)
            e["step"] == start for e in loss_curves(out.path / METRICS)[1])
        eval_pending = (bool(state.get("eval_pending")) or start >= total) and \
            not (done() if ranks is None else parallel.from_leader(done))
    if blocking := out.unreplaceable_ahead(start, total, cfg.save_steps):  # (overwrite_output_dir or not)
        raise OutputDirError(f"output_dir {out.path} holds {blocking[0].name}, which is not a slideformer checkpoint, "
                             "where this run would save that step (a save replaces only checkpoints, even with "
                             "overwrite_output_dir); move it away, or choose another output_dir")
    if not cfg.overwrite_output_dir and (foreign := out.foreign_ahead(start, total)):
        whose = "whose metadata is damaged, so whose it is cannot be told," if foreign[0].name in out.passed_over \
            else "which this run did not write and"
        raise OutputDirError(f"output_dir {out.path} holds {foreign[0].name}, {whose} would be replaced when this run "
                             "saves that step; move it away (or delete it, if it is this run's), choose another "
                             "output_dir, or set overwrite_output_dir: true")
    if lead and out.begun:  # (a new run's metrics start with its first write: OutputDir.begin)
        out.trim_metrics(start)
    order = _permutation(len(examples), cfg.seed, epoch)
    params = engine.adapter.num_params
    history, t_last, tokens_since = [], time.perf_counter(), 0
    # the logged loss: the mean over the interval's target tokens (a resumed run's interval goes on)
    logged = state.get("logged", {}) if resume else {}
    loss_sum, targets_since = float(logged.get("loss_sum", 0.0)), int(logged.get("targets", 0))
    evals = []

    def why_stop(signum, memory: bool) -> tuple[int, bool]:
        """The signal to stop for (0: none) and whether a memory guard tripped: under several ranks, any
        rank's (the largest signal number), so that every rank stops at the same step for the same reason."""
        if ranks is None:
            return signum or 0, memory
        signum, memory = parallel.largest([float(signum or 0), float(memory)], engine.device)
        return int(signum), bool(memory)

    signum, failing = 0, False
    status, dropped_steps, in_a_row, step = "finished", 0, 0, start
    saved = out.checkpoints()
    last_saved = saved[-1] if saved else None
    newest = [last_saved]  # (the watchdog's line names the newest checkpoint)
    from ..machine import host_memory
    from ..plan.memory import process_allowance

    # (made in the try below, whose end closes those made: a signal while they start leaves none behind)
    tracking = dog = guard = progress = None
    settled = None  # (whether this run froze the collector's objects, once its first step is done)
    def evaluate(step: int) -> None:
        nonlocal held
        ev = _evaluate(engine, held, cfg.micro_batch_size, tok.pad_token_id, step,
                       lambda: dog.progress(stepped=False))
        if ev is None:  # (records read as the steps reach them are first checked here)
            say(f"slideformer: step {step}: no held-out record is a sample (each malformed, or without a "
                f"target token within cutoff_len {cfg.cutoff_len}): no evaluation; check "
                + ("eval_dataset" if cfg.eval_dataset else "the dataset (val_size holds out its records)"),
                file=sys.stderr, flush=True)
            held = ()
        else:
            evals.append(ev)
            if lead:
                out.log(_finite(ev))
            tracking.scalars({"loss": ev["eval_loss"], "perplexity": ev["eval_ppl"], "tokens": ev["eval_tokens"]}, step,
                             "eval")
            say(f"slideformer: step {step}: eval loss {ev['eval_loss']:.4f}, perplexity "
                f"{ev['eval_ppl']:.3f} ({ev['eval_tokens']} tokens)", flush=True)
        dog.progress(stepped=False)

    try:
        tracking = Trackers(cfg.report_to if lead else "none", out.path, start, run_meta(cfg, engine, device),
                            purge=out.begun, run_id=out.run_id)
        progress = _progress(cfg.progress, total, start) if lead else (lambda done, rec: None)
        dog = Watchdog(cfg.watchdog_seconds, lambda: f"the last checkpoint ({newest[0]}) is intact" if newest[0]
                       else "no checkpoint was saved")
        # (several ranks on one host share its budget: the engine's host_memory_limit is this process's share,
        # plan.resolve's; each process guards it)
        guard = MemoryGuard(process_allowance(engine.cfg, host_memory() // parallel.local_world(ranks)))
        signals.training()
        if eval_pending and held:
            evaluate(step)
            t_last = time.perf_counter()  # (the next logged interval's throughput is of steps alone)
            signum, _ = why_stop(signals.requested, False)  # (a signal during it: the checkpoint is this step)
            if signum and step < total:
                status = "interrupted"
        while step < total and status != "interrupted":
            mbs, step_tokens = [], 0
            for _ in range(cfg.gradient_accumulation_steps):
                rows = cfg.micro_batch_size * world
                drawn = _draw(examples, order, offset, rows, cfg.packing, cfg.cutoff_len, tok.pad_token_id)
                if drawn is None:  # this epoch has not enough left: the next one's order
                    epoch, offset = epoch + 1, 0
                    order = _permutation(len(examples), cfg.seed, epoch)
                    drawn = _draw(examples, order, offset, rows, cfg.packing, cfg.cutoff_len, tok.pad_token_id,
                                  short=True)
                    if drawn is None:
                        raise DataError(f"no record of the dataset is a sample: {_counts(examples, skipped, dropped)}")
                    if ranks and len(drawn[0]["input_ids"]) < world:  # (a rank with no row has no step)
                        n = len(drawn[0]["input_ids"])
                        raise DataError(f"the dataset has {n} sample(s), fewer than the {world} processes, each of "
                                        f"which trains rows of every micro-batch; use nproc_per_node: {n} or more data")
                mb, offset, tokens = drawn
                mbs.append(mb)
                step_tokens += tokens
            lr = lr_at(step, cfg.learning_rate, cfg.lr_scheduler_type, warmup, total)
            engine.set_lr(lr)
            try:
                loss = engine.train_step([parallel.local_rows(mb, ranks) for mb in mbs] if ranks else mbs)
            except Exception as e:  # (the NVMe tier's disk, a worker's: what the user can resume from, said with it)
                from ..cli import _exit_code

                disk = e  # (through the wrappers the CLI looks through: those without an exit code of their own)
                while disk is not None and _exit_code(disk) is None:
                    disk = disk.__cause__
                if not (isinstance(disk, OSError) and disk.strerror):
                    raise
                kept = f"the last checkpoint ({last_saved}) is intact" if last_saved else \
                    f"it resumed from {resume}" if resume else "no checkpoint was saved"
                raise OSError(disk.errno, f"{disk.strerror} in step {step + 1} ({kept})", disk.filename) from e
            if settled is None:  # (the first step has built what the run keeps: heap.py)
                settled = heap.settle()
            norm = engine.last_grad_norm
            if not (math.isfinite(loss) and (norm is None or math.isfinite(norm))):
                what = f"loss {loss}, gradient norm {norm}"
                kept = f"the last checkpoint ({last_saved}) is intact" if last_saved else "no checkpoint was saved"
                # (one process: a rank would find only its own units', and the others would go on to their next
                # step's collectives)
                fresh = step == start == 0 and ranks is None
                if fresh and engine.last_step_dropped and (bad := engine.nonfinite_weight()):
                    raise NonFiniteLoss(f"step 1: {what}, before any update: the model's weights hold NaN or infinity "
                                        f"({bad}, as read from {cfg.model_name_or_path}); nothing was trained. Train "
                                        "a model whose weights are finite")
                if not engine.last_step_dropped:  # (no clipping: the updates ran as the gradients landed)
                    raise NonFiniteLoss(f"step {step + 1}: {what}; its update was applied in memory, so this state "
                                        f"is not saved and {kept}. Lower learning_rate (now {cfg.learning_rate}), or "
                                        "set max_grad_norm: such a step is then dropped before it is applied")
                in_a_row += 1
                if not cfg.skip_nonfinite_steps or in_a_row >= MAX_DROPPED_IN_A_ROW:
                    why = (f"{in_a_row} steps in a row were dropped" if cfg.skip_nonfinite_steps
                           else "the update was dropped")
                    raise NonFiniteLoss(f"step {step + 1}: {what}; {why}, the training state is that of step {step}; "
                                        f"stopping: {kept}. Lower learning_rate (now {cfg.learning_rate})"
                                        + ("" if cfg.skip_nonfinite_steps else
                                           ", or set skip_nonfinite_steps: true to go on past such steps"))
                dropped_steps += 1
                say(f"slideformer: step {step + 1} dropped ({what}); the data moves on, the state stays",
                    file=sys.stderr, flush=True)
                signum, _ = why_stop(signals.requested, False)
                if signum:  # the state is the last finished step's, the data past the dropped batch
                    state = {"step": step, "epoch": epoch, "offset": offset, "skipped_records": skipped,
                             "run_id": out.run_id, "data": data, "update": update, "model": model,
                             "logged": {"loss_sum": loss_sum, "targets": targets_since}}
                    last_saved = _save(engine, tok, out, step, state, cfg.save_total_limit, last_saved,
                                       cfg.model_name_or_path, dog)
                    status = "interrupted"
                    break
                continue  # the same step number, the next data
            in_a_row = 0
            dog.progress()
            targets = engine.last_step_targets  # (the loss's denominator: packed rows drop the sample starts')
            loss_sum, targets_since = loss_sum + loss * targets, targets_since + targets
            tokens_since += step_tokens
            step += 1
            if step % cfg.logging_steps == 0 or step == total:
                now = time.perf_counter()
                rec = {"step": step, "loss": loss_sum / max(targets_since, 1), "target_tokens": targets_since,
                       "lr": lr, "grad_norm": norm,
                       "tokens_per_s": tokens_since / (now - t_last),
                       "tflops": 6 * params * tokens_since / (now - t_last) / 1e12,
                       "host_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                       "epoch": epoch + offset / max(len(order), 1)}  # (with the epoch's records drawn, as HF)
                if device == "cuda":
                    rec["gpu_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
                if dropped_steps:
                    rec["dropped_steps"] = dropped_steps
                t_last, tokens_since, loss_sum, targets_since = now, 0, 0.0, 0
                history.append(rec)
                if lead:
                    out.log(_finite(rec))
                tracking.scalars({k: rec.get(k) for k in ("loss", "lr", "grad_norm", "epoch", "target_tokens",
                                                          "tokens_per_s", "tflops", "gpu_mem_gib", "host_rss_gib")},
                                 step, "train")
                progress(step, rec)
            memory = guard.tripped()
            signum, memory_somewhere = why_stop(signals.requested, memory)
            stop = bool(signum) or memory_somewhere
            due = bool(held) and ((cfg.eval_steps and step % cfg.eval_steps == 0) or step == total)
            state = {"step": step, "epoch": epoch, "offset": offset, "skipped_records": skipped,
                     "run_id": out.run_id, "data": data, "update": update, "model": model,
                     "eval_pending": due, "logged": {"loss_sum": loss_sum, "targets": targets_since}}
            saving = bool(cfg.save_steps and step % cfg.save_steps == 0) or step == total or stop
            if saving:
                last_saved = _save(engine, tok, out, step, state, cfg.save_total_limit, last_saved,
                                   cfg.model_name_or_path, dog)
                newest[0] = last_saved
                if not stop and step < total:  # (a signal during the save: its checkpoint is this step's, stop)
                    signum, _ = why_stop(signals.requested, False)
                    stop = bool(signum)
            # (after the save, which a failing evaluation must not cost; not when the run is to stop now: the
            # checkpoint says it is pending, and the resumed run runs it first where its record is not logged)
            if due and not stop:
                began = time.perf_counter()
                evaluate(step)
                t_last += time.perf_counter() - began  # (the interval's throughput is of its steps alone)
                signum, _ = why_stop(signals.requested, False)  # (a signal during it: stop here, not a step on)
                if signum and step < total:
                    if not saving:
                        last_saved = _save(engine, tok, out, step, {**state, "eval_pending": False},
                                           cfg.save_total_limit, last_saved, cfg.model_name_or_path, dog)
                        newest[0] = last_saved
                    status = "interrupted"
                    break
            if memory_somewhere and not memory:
                raise HostMemoryExceeded(f"host memory: another rank neared its share of the host budget at step {step}; "
                                         f"all stopped with {last_saved} saved (that rank's line names the fix)")
            if memory:
                raise HostMemoryExceeded(
                    f"host memory: the process reached {guard.peak / 2**30:.1f} GiB at step {step}, over "
                    f"{GUARD_FRACTION:.0%} of its {guard.budget / 2**30:.1f} GiB budget; stopped before the kernel's "
                    f"OOM killer, with {last_saved} saved. Lower offload.host_memory_limit (the planner then keeps less "
                    "in RAM), use offload.optimizer_state: 8bit or offload.offload_dir, or fewer tokens a micro-batch "
                    "(micro_batch_size, cutoff_len: a step's working set, RAM on the CPU); then resume")
            if stop:  # (a signal here, or another rank's signal or memory guard)
                status = "interrupted"
                break
    except BaseException as e:  # (the trackers' word for the run; the exception goes on)
        status, failing = "interrupted" if isinstance(e, KeyboardInterrupt) else "failed", True
        raise
    finally:
        if settled:  # (what the run held is the collector's again: a caller's next run in this process)
            heap.release()
        # every part closed whatever another's close raises (the first such error is the run's where it ended
        # without one); the watchdog last, over the trackers' close (a save's allowance: an upload's), which a
        # server gone would stall for good
        def close_trackers():
            with dog.allowing(SAVE_LIMIT_S) if dog is not None else contextlib.nullcontext():
                tracking.close(status)
        closes = [lambda: progress(None, None)] * (progress is not None) + \
            [close_trackers] * (tracking is not None) + \
            [lambda: _plot_loss(out.path / METRICS, out.path / PLOT)] * bool((history or evals) and lead) + \
            [part.close for part in (guard, dog) if part is not None]
        first = None
        for close in closes:
            try:
                close()
            except BaseException as e:  # (a signal's too: the watchdog is closed whatever)
                first = first or e
        if first is not None and not failing:
            raise first
    return {"status": status, "signal": signum, "steps": step, "history": history, "evals": evals,
            "lead": lead,
            # (a branch, resumed from another folder's checkpoint, that has saved none of its own: that one)
            "checkpoint": str(last_saved or resume) if last_saved or resume else None,
            # (read as the steps reach them: the records met so far)
            "skipped_records": skipped + getattr(examples, "skipped", 0),
            "dropped_samples": dropped + getattr(examples, "dropped", 0), "dropped_steps": dropped_steps,
            "dropped_as_met": getattr(examples, "dropped", 0), "truncated_as_met": getattr(examples, "truncated", 0)}


def _evaluate(engine, held, batch: int, pad_id: int, step: int, done=lambda: None) -> dict | None:
    """The held-out loss (mean over every target token; a MoE model's load-balancing loss included, as in
    training) and the perplexity of its cross-entropy alone, in batches of ``batch`` samples a rank; None
    where no held-out record is a sample. Under several ranks each evaluates its rows of every batch, as in
    training (the engine sums the loss over the ranks, against the batch's target count); a last batch with
    fewer rows than ranks is evaluated whole by every rank, ``batch`` rows at a time (the rows the plan
    holds), its tokens then counted once per rank by the engine's sums."""
    total, ce, tokens = 0.0, 0.0, 0
    ranks = engine.ranks
    world = ranks.world if ranks else 1
    for s in range(0, len(held), batch * world):
        rows = [e for e in held[s: s + batch * world] if e is not None]  # (None: a record that is no sample)
        if not rows:
            continue
        split = ranks is not None and len(rows) >= world
        for part in [rows] if split else [rows[i: i + batch] for i in range(0, len(rows), batch)]:
            mb = pad_batch(part, pad_id)
            r = engine.evaluate(parallel.local_rows(mb, ranks) if split else mb)
            done()  # (each batch is progress: the watchdog's)
            n = r.tokens if split else r.tokens // world
            total, ce, tokens = total + r.loss * n, ce + (r.loss - r.router_loss) * n, tokens + n
    if not tokens:
        return None
    return {"step": step, "eval_loss": total / tokens, "eval_ppl": math.exp(min(ce / tokens, 80.0)),
            "eval_tokens": tokens}


def _check_writable(folder: str, key: str) -> None:
    """``folder`` can hold files, or, where it is missing, the nearest folder above it can (the run makes it
    when it first writes there, so a refused run leaves nothing, and a folder inside output_dir is not
    taken for the user's): refused before any work, naming the key."""
    import tempfile

    p = Path(folder).absolute()
    there = next((a for a in (p, *p.parents) if a.exists()), None)
    if there is not None and not there.is_dir():
        raise ConfigError(f"{key} {folder}: {there} is a file; give a folder" if there != p else
                          f"{key} {p} is a file; give a folder")
    try:
        with tempfile.TemporaryFile(dir=there):
            pass
    except OSError as e:
        raise OSError(e.errno, f"{key} {folder}: {e.strerror} in {there}; make it writable or choose another "
                               "folder") from e


def _finite(rec: dict) -> dict:
    """JSON has no NaN: a value that is not finite is written as null."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in rec.items()}


def _samples(examples, order, offset: int):
    """The samples in ``order`` from ``offset`` on, each with the offset after it (records that are no
    sample, where they are read as the steps reach them, passed over)."""
    for k in range(offset, len(order)):
        e = examples[order[k]]
        if e is not None:
            yield e, k + 1


def _draw(examples, order, offset: int, rows: int, packing: bool, length: int, pad_id: int, short: bool = False):
    """The next micro-batch of ``rows`` rows from ``offset`` in this epoch's ``order``, the offset after it
    and its tokens (padding not counted); None where the epoch has not enough left: no sample (packed: as
    many as fill the rows of ``length`` tokens), or fewer than ``rows`` (unpacked; with ``short``, a dataset
    smaller than that, what there is)."""
    if packing:
        ends = []

        def fill():
            for e, end in _samples(examples, order, offset):
                ends.append(end)
                yield e
        mb = pack_batch(fill(), rows, length, pad_id)
        used, tokens = mb.pop("examples_used"), mb.pop("tokens_used")
        if not used:
            return None
        mb["attention_mask"] = None
        return mb, ends[used - 1], tokens
    picked = list(itertools.islice(_samples(examples, order, offset), rows))
    if not picked or (len(picked) < rows and not short):
        return None
    mb = pad_batch([e for e, _ in picked], pad_id)
    return mb, picked[-1][1], int(mb["attention_mask"].sum())


def _packed_rows(examples: list, order, length: int) -> int:
    """The rows of ``length`` tokens an epoch in ``order`` packs into (data/batches.py pack_batch's rule: a
    sample that does not fit what is left of a row starts the next)."""
    rows, col = 0, length
    for k in order:
        if examples[k] is not None:
            n = min(len(examples[k][0]), length)
            if col + n > length:
                rows, col = rows + 1, 0
            col += n
    return rows


def _counts(examples, skipped: int, dropped: int, whole: bool = False) -> str:
    """Records that were no sample: skipped as malformed, dropped without a target (up front, and as met;
    ``whole``: every record has been met)."""
    skipped += getattr(examples, "skipped", 0)
    dropped += getattr(examples, "dropped", 0)
    return f"{skipped} record(s) skipped as malformed, {dropped} with no target token within cutoff_len" \
        + ("" if whole or isinstance(examples, list) else " so far")


def _where(path) -> str:
    """A dataset's file or folder wherever the run was started from (a Hub name as it is)."""
    return os.path.realpath(path) if os.path.exists(path) else os.fspath(path)


def _model_id(cfg) -> str:
    """The model a run trains, as its checkpoints record it: "tiny", or its folder's absolute path."""
    return cfg.model_name_or_path if cfg.model_name_or_path == "tiny" else str(Path(cfg.model_name_or_path).resolve())


def _permutation(n: int, seed: int, epoch: int):
    g = torch.Generator().manual_seed((seed * 1_000_003 + epoch) % 2**64)  # (a generator's seed is 64 bits)
    return torch.randperm(n, generator=g).numpy()  # (8 bytes a record: a dataset may be larger than RAM)


def _save(engine, tok, out: OutputDir, step: int, state: dict, limit: int | None, previous: Path | None,
          source: str, dog: Watchdog) -> Path:
    """The checkpoint of ``step``: the step's updates waited for under the watchdog's limit for a step (a
    stalled update is no save's), the writing under SAVE_LIMIT_S."""
    engine.synchronize()
    with dog.allowing(SAVE_LIMIT_S):
        return _write_checkpoint(engine, tok, out, step, state, limit, previous, source)


def _write_checkpoint(engine, tok, out: OutputDir, step: int, state: dict, limit: int | None, previous: Path | None,
                      source: str) -> Path:
    target = out.path / f"{CKPT_PREFIX}{step}"
    if target.exists() and not out.overwrite and target not in out.checkpoints():
        raise OutputDirError(f"{target} appeared during the run and was not written by it; move it away and resume "
                             "with resume_from_checkpoint: auto")
    generation = Path(source) / "generation_config.json"  # (the source model's sampling defaults travel along)

    def extra(tmp):
        tok.save_pretrained(str(tmp))
        if source != "tiny" and generation.is_file():
            shutil.copyfile(generation, Path(tmp) / generation.name)

    # (a new run's history replaces an earlier one's from here; under several ranks rank 0's failure is theirs)
    out.begin() if engine.ranks is None else parallel.from_leader(out.begin)
    try:  # (the tokenizer goes in before the checkpoint is sealed: its checksums and the rename cover it)
        path = engine.save_checkpoint(target, state, extra=extra)
    except CheckpointWriteError as e:
        kept = f"the previous checkpoint {previous} is intact" if previous else "this run saved no checkpoint before"
        raise CheckpointWriteError(e.errno, f"{e.strerror}; {kept}. Free space in {out.path} (or set output_dir "
                                            "elsewhere), then resume with resume_from_checkpoint: auto") from e
    except NonFiniteStateError as e:  # (finite losses, an overflowing update: a learning rate far too large)
        kept = f"the previous checkpoint {previous} is intact" if previous else "this run saved no checkpoint before"
        raise NonFiniteStateError(f"step {step}: {e} ({kept}); the losses were finite, the update overflowed: "
                                  f"lower learning_rate (now {engine.cfg.lr})") from None
    out.passed_over.discard(target.name)  # (a damaged one of this step is replaced)
    if limit and (engine.ranks is None or engine.ranks.leader):
        out.rotate(limit, step)
    return path


def _progress(enabled: bool, total: int, start: int):
    """A rich progress bar on a terminal (plain lines when disabled or when stdout is a file or a pipe, where a
    redrawn bar would be cut): step/total, loss, lr, grad-norm, tok/s, memory, ETA. A terminal that hung up
    before its SIGHUP came is left (signals.py), not the run."""
    def surviving(show):
        def said(done, rec):
            with past_hangup():
                show(done, rec)
        return said

    if not enabled or not sys.stdout.isatty():
        def plain(done, rec):
            if rec:
                print(_line(done, total, rec), flush=True)
        return surviving(plain)
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    bar = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(), TextColumn("{task.fields[info]}"),
                   TimeRemainingColumn())
    task = bar.add_task("train", total=total, completed=start, info="")
    bar.start()

    def update(done, rec):
        if done is None:
            bar.stop()
            return
        bar.update(task, completed=done, info=_line(None, total, rec))
    return surviving(update)


def _line(done, total, r) -> str:
    head = f"step {done}/{total}  " if done is not None else ""
    gn = f"{r['grad_norm']:.3f}" if r["grad_norm"] is not None else "-"
    gpu = f"  GPU {r['gpu_mem_gib']:.1f} GiB" if "gpu_mem_gib" in r else ""  # (absent on the CPU)
    return (f"{head}loss {r['loss']:.4f}  lr {r['lr']:.2e}  grad-norm {gn}  {r['tokens_per_s']:.0f} tok/s  "
            f"{r['tflops']:.3g} TFLOPS{gpu}  host {r['host_rss_gib']:.1f} GiB")


def loss_curves(metrics: Path) -> tuple[list[dict], list[dict]]:
    """The run's logged training and held-out records, from its metrics file: a resumed run's from its first
    step (the file is trimmed to the checkpoint's step when a run resumes)."""
    history, evals = [], []
    for line in metrics.read_bytes().decode("utf-8", errors="replace").splitlines() if metrics.is_file() else ():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            if "eval_loss" in rec and (rec["eval_loss"] is None or isinstance(rec["eval_loss"], (int, float))):
                evals.append(rec)  # (null: a loss that was not finite, logged)
            elif isinstance(rec.get("loss"), (int, float)):
                history.append(rec)
    return history, evals


def _plot_loss(metrics: Path, path: Path) -> None:
    """The loss curve as a picture, at the end of the run however it ends: a picture that cannot be written
    (a full disk) is said in one line and never replaces the error that ended the run."""
    tmp = path.with_name(path.name + ".tmp.png")
    try:
        if _draw_loss(metrics, tmp):
            os.replace(tmp, path)
    except Exception as e:  # (a full disk; matplotlib's own failure)
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        why = e.strerror if isinstance(e, OSError) and e.strerror else f"{type(e).__name__}: {e}"
        print(f"slideformer: {path} not written ({why}); {metrics} has the same curve", file=sys.stderr, flush=True)


def _draw_loss(metrics: Path, path: Path) -> bool:
    """Whether a picture was drawn into ``path`` (none without a logged step, or without matplotlib)."""
    history, evals = loss_curves(metrics)
    if not history:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([h["step"] for h in history], [h["loss"] for h in history], label="train")
    if evals := [e for e in evals if e["eval_loss"] is not None]:
        ax.plot([e["step"] for e in evals], [e["eval_loss"] for e in evals], "o-", label="held out")
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def describe_data(cfg: TrainConfig, samples: int = 2, out=None) -> dict:
    """What training would see (`slideformer data`): counts for training's part and evaluation's (eval_dataset,
    or val_size's records held out), and the first ``samples`` training samples rendered with the trained
    tokens marked [[like this]]."""
    out = out or sys.stdout
    hf_config = load_model_config(cfg)  # (cutoff_len's default comes from the model)
    tok = load_tokenizer(cfg)
    for note in (template_report(cfg, tok)[1], eos_note(cfg, tok, hf_config)):
        if note:
            print(f"slideformer: {note}", file=sys.stderr, flush=True)
    vocab = vocab_limit(cfg, tok, hf_config)
    lazy, *_ = build_examples(cfg, tok, vocab, lazy=True)  # (one record at a time: any size in bounded RAM)
    train_part, held, _ = held_out(cfg, tok, vocab, lazy)
    shown = []
    stats = _tally(train_part, cfg.cutoff_len, lambda e: len(shown) < samples and shown.append(e))
    if not stats["samples"]:
        raise _none_trainable(cfg, stats["skipped_malformed"], stats["dropped_no_target"])
    if held:
        stats["eval"] = _tally(held, cfg.cutoff_len)
    for i, (ids, labels) in enumerate(shown):
        parts, run, trained = [], [], False
        for k, (t, l) in enumerate(zip(ids, labels)):
            target = k > 0 and l != -100  # (a sample's first token is never a target: nothing predicts it)
            if target != trained and run:
                text = tok.decode(run)
                parts.append(f"[[{text}]]" if trained else text)
                run = []
            trained = target
            run.append(t)
        if run:
            text = tok.decode(run)
            parts.append(f"[[{text}]]" if trained else text)
        print(f"--- sample {i + 1} ({len(ids)} tokens; [[trained]])", file=out)
        print("".join(parts), file=out)
    print(" ".join(f"{k} {v}" for k, v in stats.items() if k != "eval"), file=out)
    if held:
        print("eval: " + " ".join(f"{k} {v}" for k, v in stats["eval"].items()), file=out)
    return stats


def _tally(examples, cutoff_len: int, each=lambda e: None) -> dict:
    """Counts over lazily made samples (a LazyExamples or a view of one): its records' counters grow as each
    is met once, so a part's own counts are their growth while it is read."""
    base = getattr(examples, "base", examples)
    before = (base.truncated, base.skipped, base.dropped)
    stats = {"samples": 0, "tokens": 0, "trained_tokens": 0}
    for i in range(len(examples)):
        if (e := examples[i]) is None:
            continue
        ids, labels = e
        stats["samples"] += 1
        stats["tokens"] += len(ids)
        stats["trained_tokens"] += sum(1 for l in labels[1:] if l != -100)
        each(e)
    truncated, skipped, dropped = (now - was for now, was in zip((base.truncated, base.skipped, base.dropped), before))
    return stats | dict(truncated=truncated, skipped_malformed=skipped, dropped_no_target=dropped, cutoff_len=cutoff_len)
