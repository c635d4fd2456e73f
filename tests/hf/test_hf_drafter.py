"""`train-drafter` on a target imported with `import-hf`, then `generate --drafter` with it:
greedy speculative decoding of the imported model is its plain greedy decoding, token for
token (the acceptance rule keeps the target's output law; at temperature 0 that is argmax)."""

import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf")

# The smallest drafter run the CLI takes that still logs, checkpoints and evaluates.
DRAFTER = [
    "drafter.num_layers=1",
    "drafter.block_size=3",
    "drafter.markov_rank=4",
    "drafter.window=16",
    "train.batch_size=2",
    "train.anchors_per_seq=2",
    "train.steps=2",
    "train.log_every=1",
    "train.checkpoint_every=2",
    "train.eval_every=0",
    "train.eval_batches=1",
]
PROMPTS = ["w3 w4", "w10", ""]  # ragged, and the empty prompt (starts from eos)
NEW = 16


def _with_tokenizer(family, dst):
    """The fixture plus a 300-token WordLevel tokenizer (eos "</s>" at 2), as any
    tokenizer.json with its tokenizer_config.json."""
    import tokenizers
    from tokenizers import models, pre_tokenizers

    shutil.copytree(os.path.join(FIXTURES, family), dst)
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(297)]
    tok = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, "<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(dst, "tokenizer.json"))
    with open(os.path.join(dst, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "</s>"}, f)
    return dst


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "v41jax", *args], capture_output=True,
                          text=True, timeout=600)  # fmt: skip


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """Llama: untied embeddings (a separate lm_head), and its random greedy continuations do
    not just repeat the last token, as the tied fixtures' do, so the equality below is not
    trivial."""
    root = tmp_path_factory.mktemp("hf")
    src = _with_tokenizer("llama", str(root / "llama"))
    out = _cli("import-hf", src, "--workdir", str(root / "w"), "--config", "tiny",
               "--set", "mesh.data=1", "--set", "data.seq_len=32")  # fmt: skip
    assert out.returncode == 0, out.stderr
    return src, str(root / "w")


def _continuations(stdout, tokenizer):
    """{prompt: the generated ids} from `generate`'s output (`--- step S | 'prompt'` then the
    prompt and its decoded continuation on one line). WordLevel decodes to the words joined by
    spaces, so encoding the continuation again gives its ids back."""
    lines = stdout.strip().splitlines()
    assert len(lines) == 2 * len(PROMPTS), stdout
    out = {}
    for head, text in zip(lines[::2], lines[1::2], strict=True):
        prompt = re.fullmatch(r"--- step 0 \| '(.*)'", head).group(1)
        assert text.startswith(prompt), (prompt, text)
        out[prompt] = tokenizer.encode(text[len(prompt) :]).ids
    return out


@pytest.mark.e2e
def test_a_drafter_of_the_imported_model_decodes_its_greedy_output(imported, tmp_path):
    import tokenizers

    src, target = imported
    drafter = str(tmp_path / "drafter")
    sets = [x for s in DRAFTER for x in ("--set", s)]
    out = _cli("train-drafter", "--target-workdir", target, "--workdir", drafter, *sets,
               "--no-progress")  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["step"] == 2 and math.isfinite(result["val_loss"])
    with open(os.path.join(drafter, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    train_losses = [r["loss"] for r in records if "loss" in r]
    assert len(train_losses) == 2 and all(math.isfinite(x) for x in train_losses)
    assert os.listdir(os.path.join(drafter, "checkpoints")) == ["2"]
    with open(os.path.join(drafter, "drafter.json")) as f:
        record = json.load(f)
    assert record["target_step"] == 0 and record["target_identity"]
    with open(os.path.join(drafter, "eval.json")) as f:
        assert json.load(f) == result

    prompts = [x for p in PROMPTS for x in ("--prompt", p)]
    common = ["--workdir", target, *prompts, "--max-new-tokens", str(NEW), "--temperature", "0"]
    plain = _cli("generate", *common)
    assert plain.returncode == 0, plain.stderr
    spec = _cli("generate", *common, "--drafter", drafter, "--schedule", "fixed")
    assert spec.returncode == 0, spec.stderr

    tok = tokenizers.Tokenizer.from_file(os.path.join(src, "tokenizer.json"))
    want, got = _continuations(plain.stdout, tok), _continuations(spec.stdout, tok)
    assert got == want
    assert all(len(ids) == NEW for ids in want.values()), want  # no eos cut any short
    assert len({tuple(ids) for ids in want.values()}) == len(PROMPTS)  # not all one sequence
    # the drafter's tokens were proposed and verified: between 1 and block_size = 3 tokens per
    # round, strictly, so some drafts were accepted and some rejected (and corrected)
    stat = re.search(r"drafter .*: (\d+\.\d+) tokens per round \(fixed, padded\)", spec.stderr)
    assert stat, spec.stderr
    assert 1.0 < float(stat.group(1)) < 3.0, spec.stderr
