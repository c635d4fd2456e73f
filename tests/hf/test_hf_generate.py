"""An imported model continues a prompt as transformers does: `generate --temperature 0` on
each committed fixture (tests/fixtures/hf/<family>: a complete HF directory, imported as it
is) gives transformers' greedy tokens (generate.json, made by scripts/make_hf_fixtures.py),
because its prompts start as its tokenizer's template starts a text (Llama's and Mistral's
BOS, Qwen's nothing), not with v41jax's document separator. The data that `eval` and a
drafter's training read starts each document the same way, and a drafter of the imported
model decodes to the same tokens."""

import dataclasses
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from v41jax.data import Tokenizer, train_tokenizer

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf")
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
COPIES = 12  # documents per fixture prompt in the corpus
DATA = ["data.max_documents=0", "data.val_fraction=0.25", "data.seq_len=8",
        "data.global_batch_size=2", "data.vocab_size=300", "mesh.data=1"]  # fmt: skip
DRAFTER = ["drafter.num_layers=1", "drafter.block_size=3", "drafter.markov_rank=4",
           "drafter.window=16", "train.batch_size=2", "train.anchors_per_seq=2", "train.steps=2",
           "train.log_every=1", "train.checkpoint_every=2", "train.eval_every=0",
           "train.eval_batches=1"]  # fmt: skip


def _golden(family):
    with open(os.path.join(FIXTURES, family, "generate.json")) as f:
        return json.load(f)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "v41jax", *args], capture_output=True,
                          text=True, timeout=600)  # fmt: skip


def _sets(*settings):
    return [x for s in settings for x in ("--set", s)]


def _cut(ids, eos):
    return ids[: ids.index(eos)] if eos in ids else list(ids)


def _continuations(stdout, tok, prompts):
    """The generated ids of each prompt from `generate`'s output (`--- step S | 'prompt'`, then
    the prompt and its decoded continuation). The fixtures' WordLevel tokenizers decode to the
    tokens joined by spaces, so encoding the continuation again gives its ids back."""
    lines = stdout.strip().splitlines()
    assert len(lines) == 2 * len(prompts), stdout
    out = []
    for prompt, head, text in zip(prompts, lines[::2], lines[1::2], strict=True):
        assert re.fullmatch(r"--- step 0 \| '(.*)'", head).group(1) == prompt, head
        assert text.startswith(prompt), (prompt, text)
        out.append(tok.encode(text[len(prompt) :]))
    return out


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """{family: (workdir, token dir)}: each fixture imported straight from its directory, its
    run reading a token dir of COPIES documents per fixture prompt made with its tokenizer."""
    root = tmp_path_factory.mktemp("hf_generate")
    docs = root / "docs"
    docs.mkdir()
    texts = [p["text"] for p in _golden("llama")["prompts"] if p["text"]]
    for i, text in enumerate(texts * COPIES):
        (docs / f"doc{i:03d}.txt").write_text(text + "\n")
    out = {}
    for family in FAMILIES:
        src, token_dir, work = os.path.join(FIXTURES, family), root / f"td_{family}", root / family
        data = [f"data.paths={docs}", *DATA]
        tok = os.path.join(src, "tokenizer.json")
        made = _cli("prepare-data", "--config", "tiny", *_sets(*data), "--out", str(token_dir),
                    "--tokenizer", tok, "--no-progress")  # fmt: skip
        assert made.returncode == 0, made.stderr
        got = _cli("import-hf", src, "--workdir", str(work), "--config", "tiny",
                   *_sets(*data, f"data.token_dir={token_dir}"))  # fmt: skip
        assert got.returncode == 0, got.stderr
        out[family] = (str(work), str(token_dir))
    return out


def test_the_prompt_prefix_is_the_tokenizers_template():
    for family in FAMILIES:
        tok = Tokenizer.load(os.path.join(FIXTURES, family, "tokenizer.json"))
        assert tok.hf and tok.document_prefix == ((1,) if family in ("llama", "mistral") else ())
        for p in _golden(family)["prompts"]:  # transformers' encoding, template and all
            assert tok.prompt_ids(p["text"]) == p["input_ids"], (family, p)
    assert tok.prompt_ids("") == [tok.eos_id]  # Qwen: an empty prompt starts after an eos
    own = train_tokenizer(["the cat sat on the mat"] * 4, 260)  # v41jax's: after the separator
    assert not own.hf and own.document_prefix == (0,) and own.prompt_ids("") == [0]
    assert own.prompt_ids("the cat") == [0, *own.encode("the cat")]


def test_an_hf_tokenizer_stays_one_through_save_and_load(tmp_path):
    """Qwen2's eos is `<|endoftext|>`, v41jax's name: its saved copy (a fine-tuned run's, a
    token dir's) still has its tokenizer_config.json, so it still starts texts with nothing."""
    tok = Tokenizer.load(os.path.join(FIXTURES, "qwen2", "tokenizer.json"))
    assert tok.eos_token == "<|endoftext|>" and tok.document_prefix == ()
    tok.save(str(tmp_path / "tokenizer.json"))
    again = Tokenizer.load(str(tmp_path / "tokenizer.json"))
    assert again.hf and again.document_prefix == () and again.eos_id == tok.eos_id


@pytest.mark.e2e
def test_generate_on_an_imported_model_gives_transformers_greedy_tokens(imported):
    for family in FAMILIES:
        golden = _golden(family)
        prompts = [p["text"] for p in golden["prompts"]]
        gen = _cli("generate", "--workdir", imported[family][0], *[x for p in prompts
                   for x in ("--prompt", p)], "--max-new-tokens", str(golden["max_new_tokens"]),
                   "--temperature", "0")  # fmt: skip
        assert gen.returncode == 0, gen.stderr
        tok = Tokenizer.load(os.path.join(imported[family][0], "tokenizer.json"))
        got = _continuations(gen.stdout, tok, prompts)
        want = [_cut(p["greedy"], golden["eos_id"]) for p in golden["prompts"]]
        assert got == want, family


@pytest.mark.e2e
def test_negative_control_the_old_eos_prefix_gives_other_tokens(imported):
    """v41jax's separator before an imported model's prompt (what `generate` did) changes its
    greedy continuation: the test above can fail."""
    import jax

    from v41jax.decode import SamplingParams, generate
    from v41jax.train import load_run

    differs = 0
    for family in ("llama", "qwen3"):
        run, golden = load_run(imported[family][0]), _golden(family)
        for p in golden["prompts"]:
            ids = [run.tokenizer.eos_id, *run.tokenizer.encode(p["text"])]
            out = generate(run.params, run.cfg.model, np.array([ids], np.int32),
                           np.array([len(ids)], np.int32), max_new_tokens=len(p["greedy"]),
                           rng=jax.random.PRNGKey(0), sampling=SamplingParams(0.0))  # fmt: skip
            differs += [int(t) for t in np.asarray(out)[0]] != p["greedy"]
    assert differs > 0


def _documents(token_dir, split):
    tokens = np.load(os.path.join(token_dir, f"{split}_tokens.npy"))
    offsets = np.load(os.path.join(token_dir, f"{split}_doc_offsets.npy"))
    return [tokens[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:], strict=True)]


@pytest.mark.e2e
def test_each_document_starts_as_the_tokenizer_starts_a_text(imported):
    """The token dirs that `eval` and `train-drafter` read (the imported runs' data): each
    document is transformers' encoding of its text (Llama's with its BOS, Qwen's without)
    followed by the eos."""
    for family in FAMILIES:
        golden = _golden(family)
        want = {tuple(p["input_ids"]) + (golden["eos_id"],) for p in golden["prompts"]
                if p["text"]}  # fmt: skip
        docs = _documents(imported[family][1], "train") + _documents(imported[family][1],
                                                                      "validation")  # fmt: skip
        assert len(docs) == len(want) * COPIES and {tuple(d) for d in docs} == want, family


@pytest.mark.e2e
def test_eval_and_a_drafter_of_an_imported_model(imported, tmp_path):
    """`eval` reads those documents; a drafter trained on them (anchors in documents that start
    with the BOS) decodes to transformers' greedy tokens at temperature 0."""
    work = imported["llama"][0]
    ev = _cli("eval", "--workdir", work)
    assert ev.returncode == 0, ev.stderr
    result = json.loads(ev.stdout)
    assert result["step"] == 0 and math.isfinite(result["val_loss"]), result
    drafter = str(tmp_path / "drafter")
    out = _cli("train-drafter", "--target-workdir", work, "--workdir", drafter,
               *_sets(*DRAFTER), "--no-progress")  # fmt: skip
    assert out.returncode == 0, out.stderr
    golden = _golden("llama")
    prompts = [p["text"] for p in golden["prompts"]]
    spec = _cli("generate", "--workdir", work, *[x for p in prompts for x in ("--prompt", p)],
                "--max-new-tokens", str(golden["max_new_tokens"]), "--temperature", "0",
                "--drafter", drafter, "--schedule", "fixed")  # fmt: skip
    assert spec.returncode == 0, spec.stderr
    tok = Tokenizer.load(os.path.join(work, "tokenizer.json"))
    want = [_cut(p["greedy"], golden["eos_id"]) for p in golden["prompts"]]
    assert _continuations(spec.stdout, tok, prompts) == want


@pytest.mark.e2e
def test_a_token_dir_prepared_before_framing_is_refused(imported, tmp_path):
    """A Llama token dir whose manifest records no document start (prepared before documents
    were framed with the BOS) holds streams the model never saw: loading it is refused by name;
    the same folder as written loads."""
    import shutil

    from v41jax import config as config_lib
    from v41jax.data import load_data

    old = tmp_path / "old"
    shutil.copytree(imported["llama"][1], old)
    manifest = json.loads((old / "manifest.json").read_text())
    assert manifest.pop("document_start") == [1]
    (old / "manifest.json").write_text(json.dumps(manifest))
    cfg = config_lib.load_json(os.path.join(imported["llama"][0], "config.json"))
    assert load_data(cfg.data).tokenizer.document_prefix == (1,)  # the folder as written
    with pytest.raises(ValueError, match=r"old: its documents start with ids \[\], .* \[1\]"):
        load_data(dataclasses.replace(cfg.data, token_dir=str(old)))
