"""Every command that writes into a folder recognises what the folder holds and refuses
another kind by name, before writing anything: each writing command (train, train-drafter,
import-hf, export-hf, sweep and its cells, report, prepare-data) x each kind of folder (a
train run, a drafter run, an imported model, a sweep's runs, a finished sweep run, a report,
token files, a Hugging Face directory, other files, a file), through the CLI; the folder's
digest is the same after every refusal and nothing appears beside it. The example folders
are real: made by the commands that write them (a 2-step tiny run, a 2-step drafter, ...)."""

import hashlib
import json
import os
import shutil
import textwrap

import pytest

from v41jax import config as config_lib
from v41jax.__main__ import main
from v41jax.data import write_token_dir
from v41jax.dspark.train.config import DrafterRunConfig
from v41jax.dspark.train.loop import train_drafter
from v41jax.hf.workdir import export_hf, import_hf
from v41jax.sweep import RunSpec, record_setting, write_report
from v41jax.sweep.driver import write_result
from v41jax.train import train
from v41jax.train.workdir_kind import LABELS, READERS, WRITERS, require_kind, workdir_kind

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf")
FAST = ["train.steps=2", "train.eval_every=0", "train.checkpoint_every=2", "train.log_every=1"]
KINDS = ["missing", "empty", "file", "other", "train_run", "sweep_cell", "imported",
         "drafter_run", "sweep_runs", "report", "token_dir", "hf_model", "hf_export"]  # fmt: skip
SWEEP = textwrap.dedent(
    f"""
    from v41jax import config as config_lib
    from v41jax.sweep import RunSpec

    SETTINGS = ("toy",)

    def get_sweep(setting="toy"):
        cfg = config_lib.override(config_lib.get_config("tiny"), {FAST!r})
        return [RunSpec("s", "a", 0, cfg)]
    """
)


def tiny():
    return config_lib.override(config_lib.get_config("tiny"), FAST)


def digest(path) -> dict | None:
    """{relative path: sha256} of every file under `path` (a file: {"": sha256}; None when
    nothing is there)."""
    if not os.path.exists(path):
        return None
    if os.path.isfile(path):
        with open(path, "rb") as f:
            return {"": hashlib.sha256(f.read()).hexdigest()}
    out = {}
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            full = os.path.join(root, name)
            rel = os.path.relpath(full, path)
            if name in files:
                with open(full, "rb") as f:
                    out[rel] = hashlib.sha256(f.read()).hexdigest()
            else:
                out[rel + "/"] = "dir"
    return out


def _hf_source(dst):
    """The Llama fixture plus a 300-token WordLevel tokenizer (as tests/hf make one)."""
    import tokenizers
    from tokenizers import models, pre_tokenizers

    shutil.copytree(os.path.join(FIXTURES, "llama"), dst)
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(297)]
    tok = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, "<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(dst, "tokenizer.json"))
    with open(os.path.join(dst, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "</s>"}, f)
    return dst


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """{kind: a folder of that kind} (under `examples/`) and the inputs the commands read."""
    root = tmp_path_factory.mktemp("kinds")
    ex = root / "examples"
    ex.mkdir()
    k = {name: str(ex / name) for name in KINDS}
    (ex / "empty").mkdir()
    (ex / "file").write_text("not a folder\n")
    (ex / "other").mkdir()
    (ex / "other" / "notes.txt").write_text("my notes\n")
    train(tiny(), k["train_run"], progress=False)
    drafter = config_lib.override(DrafterRunConfig(), [
        "drafter.num_layers=1", "drafter.block_size=3", "drafter.window=16",
        "train.batch_size=8", "train.anchors_per_seq=2", "train.steps=2",
        "train.checkpoint_every=2", "train.log_every=1", "train.eval_every=0",
        "train.eval_batches=1"])  # fmt: skip
    train_drafter(drafter, k["train_run"], k["drafter_run"], progress=False)
    shutil.copytree(k["train_run"], k["sweep_cell"])
    spec = RunSpec("s", "a", 0, tiny())
    with open(os.path.join(k["train_run"], "eval.json")) as f:
        write_result(spec, k["sweep_cell"], json.load(f))
    with open(os.path.join(k["sweep_cell"], "done.json"), "w") as f:
        json.dump({"eval": {}}, f)
    record_setting(k["sweep_runs"], "toy_sweep.py", "toy")
    shutil.copytree(k["sweep_cell"], spec.workdir(k["sweep_runs"]))
    (root / "exp").mkdir()
    write_report(str(root / "exp"), k["sweep_runs"], out_dir=k["report"], echo=False)
    write_token_dir(config_lib.get_config("tiny"), k["token_dir"])
    _hf_source(k["hf_model"])
    import_hf(k["hf_model"], k["imported"], "tiny", ["mesh.data=1", "data.seq_len=32"])
    export_hf(k["imported"], k["hf_export"], "llama")
    (root / "toy_sweep.py").write_text(SWEEP)
    return {"kinds": k, "root": str(root), "examples": str(ex)}


def test_each_example_is_recognised_as_its_kind(world, tmp_path):
    k = world["kinds"]
    got = {name: workdir_kind(path).name for name, path in k.items()}
    assert got == {**{n: n for n in KINDS}, "hf_export": "hf_model"}
    assert workdir_kind(k["hf_export"]).evidence == "v41jax_export.json"
    assert workdir_kind(k["imported"]).evidence == "checkpoint 0 records imported_from"
    # a sweep's runs written without sweep.json (run_sweep from Python) are found by a run
    cell = RunSpec("s", "a", 0, tiny()).workdir(str(tmp_path / "runs"))
    shutil.copytree(k["sweep_cell"], cell)
    assert workdir_kind(tmp_path / "runs").evidence == "s/a_seed0/config.json"
    # a folder holding only a lock is empty; a folder of drafter runs is no kind
    (tmp_path / "locked").mkdir()
    (tmp_path / "locked" / ".v41jax.lock").write_text("{}")
    assert workdir_kind(tmp_path / "locked").name == "empty"
    shutil.copytree(k["drafter_run"], tmp_path / "drafters" / "a" / "b")
    assert workdir_kind(tmp_path / "drafters").name == "other"


def _argv(command, world, folder):
    k, root = world["kinds"], world["root"]
    # fmt: off
    argv = {
        "train": ["train", "--workdir", folder, "--no-progress"],  # no --config: the worst
        "train-drafter": ["train-drafter", "--target-workdir", k["train_run"], "--workdir",
                          folder, "--no-progress"],
        "import-hf": ["import-hf", k["hf_model"], "--workdir", folder, "--config", "tiny"],
        "export-hf": ["export-hf", "--workdir", k["imported"], "--out", folder, "--family",
                      "llama"],
        "sweep": ["sweep", os.path.join(root, "toy_sweep.py"), "--setting", "toy",
                  "--runs-dir", folder, "--no-progress"],
        "report": ["report", os.path.join(root, "exp"), "--runs-dir", k["sweep_runs"],
                   "--out-dir", folder, "--quiet"],
        "prepare-data": ["prepare-data", "--config", "tiny", "--out", folder, "--no-progress"],
    }
    # fmt: on
    return argv[command]


COMMANDS = ["train", "train-drafter", "import-hf", "export-hf", "sweep", "report",
            "prepare-data"]  # fmt: skip


def _refused(argv, folder, world, capsys, *also) -> str:
    """Run the CLI; it must return 2, print one error line, and change neither `folder`,
    the other example folders, nor what lies beside them."""
    capsys.readouterr()
    before = {p: digest(p) for p in (folder, world["examples"], *also)}
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert {p: digest(p) for p in before} == before
    return err


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("kind", KINDS)
def test_a_writer_refuses_every_other_kind_and_changes_nothing(world, command, kind, capsys):
    folder = world["kinds"][kind]
    role_kind = workdir_kind(folder).name
    if role_kind in WRITERS[command][2]:  # accepted: checked, not run (other tests run it)
        assert require_kind(folder, command).name == role_kind
        return
    with pytest.raises(ValueError):
        require_kind(folder, command)
    err = _refused(_argv(command, world, folder), folder, world, capsys)
    assert folder in err and LABELS[role_kind].split(" (")[0] in err, err
    assert f"{command} writes" in err, err


@pytest.mark.parametrize("kind", [k for k in KINDS if k not in ("missing", "empty")])
def test_a_sweep_refuses_a_cell_of_another_kind(world, kind, tmp_path, capsys):
    """A runs dir whose cell holds something else: refused naming the cell, before the
    sweep writes anything (sweep.json included)."""
    runs = str(tmp_path / "runs")
    cell = RunSpec("s", "a", 0, tiny()).workdir(runs)
    os.makedirs(os.path.dirname(cell))
    src = world["kinds"][kind]
    (shutil.copytree if os.path.isdir(src) else shutil.copyfile)(src, cell)
    if kind in ("train_run", "sweep_cell"):  # the cells a sweep continues: accepted
        assert require_kind(cell, "sweep-cell").name == kind
        return
    err = _refused(_argv("sweep", world, runs), runs, world, capsys)
    assert cell in err and "sweep writes" in err, err


@pytest.mark.parametrize(
    "argv_of, kind, named",
    [
        (lambda k, new: ["train-drafter", "--target-workdir", k["drafter_run"], "--workdir",
                         new, "--no-progress"], "drafter_run", "--target-workdir"),
        (lambda k, new: ["train-drafter", "--target-workdir", k["hf_model"], "--workdir",
                         new, "--no-progress"], "hf_model", "import-hf"),
        (lambda k, new: ["train", "--config", "tiny", "--workdir", new, "--set",
                         f"train.init_from={k['hf_model']}"], "hf_model", "train.init_from"),
        (lambda k, new: ["train", "--config", "tiny", "--workdir", new, "--set",
                         f"train.init_from={k['drafter_run']}"], "drafter_run", "drafter run"),
        (lambda k, new: ["export-hf", "--workdir", k["drafter_run"], "--out", new, "--family",
                         "llama"], "drafter_run", "not a train run or an imported model"),
        (lambda k, new: ["report", os.path.dirname(new), "--runs-dir", k["train_run"],
                         "--out-dir", new, "--quiet"], "train_run", "not a sweep's runs"),
    ],
)  # fmt: skip
def test_a_folder_read_as_a_run_must_be_one(world, argv_of, kind, named, tmp_path, capsys):
    """The folders a command only reads are recognised too, before the new one is made."""
    new = str(tmp_path / "new")
    err = _refused(argv_of(world["kinds"], new), world["kinds"][kind], world, capsys, new)
    assert named in err and world["kinds"][kind] in err, err
    assert not os.path.exists(new)


def test_accepting_tables_name_known_kinds_and_commands():
    """Negative control for the matrix: every kind a role accepts is a real kind, and a
    refusal names the command that fits the folder."""
    for _, _, accepted in [*WRITERS.values(), *READERS.values()]:
        assert set(accepted) <= set(LABELS)
    assert {"train", "train-drafter", "import-hf", "export-hf", "sweep", "report",
            "prepare-data"} <= set(WRITERS)  # fmt: skip


def test_the_issue_case_names_the_drafter_run(world, capsys):
    """`train --config tiny --workdir <a drafter's workdir>`: refused in one line that says
    what the folder holds and which command resumes it; nothing written."""
    folder = world["kinds"]["drafter_run"]
    argv = ["train", "--config", "tiny", "--workdir", folder, "--no-progress"]
    err = _refused(argv, folder, world, capsys)
    assert err.strip() == (
        f"error: {folder} already holds a drafter run (drafter.json): train writes train "
        f"runs; use a new --workdir, or train-drafter --workdir {folder} to resume it"
    )
