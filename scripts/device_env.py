"""The machine side of the device check (`scripts/device_check.py`): what JAX sees in a
fresh process, host facts (versions, nvidia-smi), wheels carried to an offline machine, and
a command runner whose timeout kills the whole process group.

Standard library only: it must run before any missing wheel is installed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import zipfile
from importlib import metadata

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # scripts/.. = the checkout
TAIL_CHARS = 4000
PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "chex", "numpy", "pytest")
# The probe runs in a fresh interpreter with the stages' environment: `platform` is the
# JAX_PLATFORMS value for the stages (jax.default_backend() says "gpu" for CUDA and ROCm).
PROBE = r"""
import json, sys
out = {"python": sys.version.split()[0], "executable": sys.executable}
try:
    import jax
    devs = jax.devices()
    out["backend"] = jax.default_backend()
except Exception as e:  # no JAX, or no backend it can start
    devs, out["backend"], out["error"] = [], "none", f"{type(e).__name__}: {e}"
version = ""
try:  # optional facts: their absence must not hide the accelerator
    version = devs[0].client.platform_version or ""
except Exception:
    pass
out["platform_version"] = version
gpu = "rocm" if "rocm" in version.lower() else "cuda"
out["platform"] = {"gpu": gpu}.get(out["backend"], out["backend"])
out["devices"] = []
for d in devs:
    stats = {}
    try:
        stats = d.memory_stats() or {}
    except Exception:
        pass
    kind = getattr(d, "device_kind", str(d))
    out["devices"].append({"kind": kind, "id": d.id, "memory_bytes": stats.get("bytes_limit")})
print("PROBE" + json.dumps(out))
"""


def tail(text: str, n: int = TAIL_CHARS) -> str:
    return text if len(text) <= n else "..." + text[-n:]


def run_command(command: list[str], timeout_s: float, env: dict, log_path: str) -> dict:
    """Run `command` (its own process group, output to `log_path`); on timeout the whole
    group is killed, so a hung compile or child process cannot outlive its stage."""
    start = time.monotonic()
    with open(log_path, "w") as log:
        try:
            proc = subprocess.Popen(
                command,
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError as e:
            return {
                "status": "failed",
                "returncode": None,
                "duration_s": 0.0,
                "output_tail": f"could not start {command[0]!r}: {e}",
            }
        try:
            rc = proc.wait(timeout=max(timeout_s, 1))
            status = "passed" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended between the timeout and the kill
                pass
            rc, status = proc.wait(), "timeout"
    with open(log_path, errors="replace") as f:
        output = f.read()
    return {
        "status": status,
        "returncode": rc,
        "duration_s": round(time.monotonic() - start, 2),
        "output_tail": tail(output),
    }


def wheel_dist(filename: str) -> str:
    """Distribution name of a wheel file, as importlib.metadata looks it up."""
    return re.sub(r"[-_.]+", "-", os.path.basename(filename).split("-")[0]).lower()


def _version(filename: str) -> str:
    parts = os.path.basename(filename).split("-")
    return parts[1] if len(parts) > 1 else ""


def _supported_tags() -> set[str] | None:
    for mod in ("packaging.tags", "pip._vendor.packaging.tags"):
        try:
            tags = __import__(mod, fromlist=["sys_tags"])
            return {str(t) for t in tags.sys_tags()}
        except ImportError:
            continue
    return None  # no tag list: every wheel is tried


def wheel_compatible(filename: str, supported: set[str] | None) -> bool:
    if supported is None:
        return True
    parts = os.path.basename(filename)[: -len(".whl")].split("-")
    pys, abis, plats = (p.split(".") for p in parts[-3:])
    return any(f"{p}-{a}-{q}" in supported for p in pys for a in abis for q in plats)


def select_wheels(wheel_dir: str, force_all: bool = False) -> dict[str, list[str]]:
    """{"install": [...], "present": [...], "incompatible": [...]} of `wheel_dir`'s wheels:
    the newest compatible wheel of each distribution this Python lacks (`force_all`: of
    every distribution, installed or not)."""
    out = {"install": [], "present": [], "incompatible": []}
    if not os.path.isdir(wheel_dir):
        return out
    supported, chosen = _supported_tags(), set()
    newest_first = lambda n: (wheel_dist(n), [-int(v) for v in re.findall(r"\d+", _version(n))])
    for name in sorted((n for n in os.listdir(wheel_dir) if n.endswith(".whl")), key=newest_first):
        if not name.endswith(".whl"):
            continue
        path, dist = os.path.join(wheel_dir, name), wheel_dist(name)
        if not wheel_compatible(name, supported):
            out["incompatible"].append(name)
            continue
        try:
            installed = metadata.version(dist) if not force_all else None
        except metadata.PackageNotFoundError:
            installed = None
        if installed is not None:
            out["present"].append(f"{name} (installed: {dist} {installed})")
        elif dist not in chosen:
            chosen.add(dist)
            out["install"].append(path)
    return out


def install_wheels(paths: list[str], site: str, env: dict, log_path: str) -> dict:
    """pip install --no-index --no-deps --target `site`; unzips them where pip is missing
    (a wheel is a zip of its site-packages files)."""
    if not paths:
        return {"status": "passed", "installed": [], "site": site}
    os.makedirs(site, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-index",
        "--no-deps",
        "--disable-pip-version-check",
        "--target",
        site,
        *paths,
    ]
    has_pip = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True)
    if has_pip.returncode == 0:
        result = run_command(cmd, 240, env, log_path)
    else:
        for p in paths:
            with zipfile.ZipFile(p) as z:
                z.extractall(site)
        result = {"status": "passed", "output_tail": "pip missing: wheels unzipped"}
    return dict(result, installed=[os.path.basename(p) for p in paths], site=site)


def probe(env: dict) -> dict:
    """What JAX sees in a fresh process with `env` (JAX_PLATFORMS as the caller set it)."""
    try:
        r = subprocess.run(
            [sys.executable, "-c", PROBE],
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
            cwd=ROOT,
        )
    except subprocess.TimeoutExpired:
        return {"backend": "none", "error": "the JAX probe timed out after 180 s"}
    line = next((s for s in r.stdout.splitlines() if s.startswith("PROBE")), None)
    if line is None:
        return {"backend": "none", "error": tail(r.stderr or r.stdout, 2000)}
    return json.loads(line[len("PROBE") :])


def pinned_versions() -> dict[str, str]:
    """`name==version` lines of requirements.txt (the versions tested together on CPU)."""
    pins = {}
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        for line in f:
            if m := re.match(r"\s*([A-Za-z0-9_.-]+)==([^\s;#]+)", line):
                pins[m.group(1).lower()] = m.group(2)
    return pins


def versions_line(installed: dict[str, str | None], pins: dict[str, str]) -> str:
    """ "jax 0.11.2 (requirements.txt: 0.10.2), flax MISSING (...), ..." for the key packages,
    so a run on a preinstalled JAX says plainly that it is not the pinned one."""
    out = []
    for name in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint"):
        have, pin = installed.get(name), pins.get(name)
        note = "" if have == pin or pin is None else f" (requirements.txt: {pin})"
        out.append(f"{name} {have or 'MISSING'}{note}")
    return ", ".join(out)


def host_info() -> dict:
    info = {"package_versions": {}, "requirements_pins": pinned_versions()}
    for name in PACKAGES:
        try:
            info["package_versions"][name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            info["package_versions"][name] = None
    plugins = [d.metadata["Name"] for d in metadata.distributions() if d.metadata["Name"]]
    for name in sorted({p for p in plugins if re.match(r"(jax[-_]cuda|libtpu|jax[-_]rocm)", p)}):
        info["package_versions"][name] = metadata.version(name)
    try:
        q = "name,memory.total,driver_version"
        r = subprocess.run(
            ["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        info["nvidia_smi"] = [s.strip() for s in r.stdout.splitlines() if s.strip()]
    except (OSError, subprocess.TimeoutExpired):
        info["nvidia_smi"] = None
    return info
