"""The README's summary table of the plans in this folder: `python experiments/plan/table.py`.

Per plan, beside the XLA:CPU estimate, the compiler's own figures for the chip it names
(`target_compile`: `plan --topology` / `--gpu`): temporaries, peak and the fit verdict with
its margin are the target's; a plan without a target compile says so.
"""

import json
import os
import re

HERE = os.path.dirname(os.path.abspath(__file__))
ORDER = [
    "1b_tpu",
    "1b-engram_tpu",
    "1b-mhc_tpu",
    "1b_tpu_blockwise",
    "8b_cuda",
    "8b-engram_cuda",
    "8b-mhc_cuda",
    "1b-engram_tpu_nomicro",
    "1b-mhc_tpu_nomicro",
    "8b-engram_cuda_nomicro",
    "8b-mhc_cuda_nomicro",
    "1b_tpu_unscanned",
    "1b_tpu_unscanned_noremat",
    "1b_tpu_full_logits",
    "8b_tpu",
    "8b_tpu_v5p",
]
GIB = 1 << 30


def row(name: str) -> str:
    with open(os.path.join(HERE, f"{name}.json")) as f:
        return row_of(json.load(f), name)


def row_of(r: dict, name: str) -> str:
    """One table row of plan `r` (a plan JSON's content) named `name`."""
    b, s, t = r["bytes_per_device"], r["settings"], r.get("target_compile")
    if t:
        chip = f"{t['devices']} x {t['chip']}"
        hbm = f"{t['device_memory'] / GIB:.2f}"
        if t.get("compiler_error"):  # libtpu refused it: temporaries over the chip's HBM
            need = re.search(r"HLO temporaries \(([^)]+)\)", t["compiler_error"])
            temps = f"{need.group(1)} (refused)" if need else "refused"
            peak, fits = f"- / {hbm}", "**no**: the compiler refuses it"
        else:
            temps = f"{t['memory']['temp_size_in_bytes'] / GIB:.2f}"
            peak = f"**{t['peak_bytes'] / GIB:.2f}** / {hbm}"
            margin = t["headroom_bytes"] / GIB
            fits = f"yes ({margin:.2f} GiB free)" if t["fits"] else f"**no** ({-margin:.2f} over)"
        compile_s = f"{r['compile_seconds']:.0f} + {t['compile_seconds']:.0f} s"
    else:
        chip, temps, peak, fits = r["device"], "not compiled", "", "not compiled"
        compile_s = f"{r['compile_seconds']:.0f} s"
    return (
        f"| `{name}` | {chip} | {r['params'] / 1e9:.3f}B | {r['global_batch'][0]} x "
        f"{r['global_batch'][1]} / {s['microbatches']} | {b['params'] / GIB:.2f} | "
        f"{b['optimizer_state'] / GIB:.2f} | {b['temporaries'] / GIB:.2f} | {temps} | "
        f"{b['peak'] / GIB:.2f} | {peak} | {fits} | {100 * r['mfu_bound']:.1f}% | "
        f"{r['step_seconds_at_peak']:.2f} s | {compile_s} |"
    )


def main() -> None:
    print(
        "| plan | chip | params | batch x T / microbatches | params GiB | optimizer GiB | "
        "temporaries GiB, CPU estimate | temporaries GiB, compiled | peak GiB, CPU estimate | "
        "peak / usable memory GiB, compiled | fits (compiled) | MFU bound | step at peak | "
        "compile (CPU + chip) |"
    )
    print("|" + " --- |" * 14)
    for name in ORDER:
        if os.path.exists(os.path.join(HERE, f"{name}.json")):
            print(row(name))


if __name__ == "__main__":
    main()
