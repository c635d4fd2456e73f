"""File-backed Engram tables (`TableFile`): gathered rows/s and page-cache hit rate vs size.

Per table size (float32 rows of `--dim`, default 1, 8 and 36 GiB; the last is over 1.5x the
RAM of the 2-core 24 GiB VM): create it lazy (instant, sparse), time a first gather of
untouched rows (generated from the init recipe), materialise every row (contiguous
`update_rows` chunks, disk-bound) and flush. The page cache then holds what the kernel kept
of the writes (all of a table that fits, the last-written part of a bigger one): a full
cache, as in a long run. `--cold` drops the file from it (posix_fadvise DONTNEED) to time
warming up from nothing instead. Then, per id distribution, a warm-up of
`--warmup` steps (continued while under 99% of the ids hit, up to `--warmup-seconds`), then
up to `--iters` timed steps (at most `--case-seconds` a case) of `--batch` x `--seq` tokens
x `--heads` ids:

  zipf     ranks ~ Zipf(a) (rejected above R), mapped to rows by a fixed affine permutation
           (rank * A + B mod R, A prime and coprime to R): hot rows scattered over the file
           like hashed n-gram ids
  uniform  ids uniform over the rows (the worst case)

Reported per step, after warm-up: rows/s, tokens/s (rows / heads), the id hit rate (the
fraction of ids whose 4 KiB page was resident before the step, by mincore(2)), major page
and minor page faults (getrusage; each case opens its own mapping and warms it with
`--warmup` steps first, since a fresh mapping minor-faults on its first touch of every
page), and, for zipf, the hit rate an ideal row cache holding the same bytes
as the resident pages would get (the draws of the top-K ranks): the page cache keeps 4 KiB
pages, so a hot row drags cold neighbours in. `in_ram` rows: the same ids gathered from an
in-memory copy (`HostTable`), the upper bound of any explicit cache. Big files go under
`--dir` and are deleted after each size.
"""

from __future__ import annotations

import ctypes
import os
import resource
import shutil
import time

import numpy as np

from v41jax.bench.common import format_table, machine_info, write_json
from v41jax.engram.host_table import HostTable
from v41jax.engram.primes import next_prime_above
from v41jax.engram.table_file import TableFile, create_table_file

PAGE = os.sysconf("SC_PAGE_SIZE")
_LIBC = ctypes.CDLL(None, use_errno=True)
QUICK = {"sizes_gib": "0.25,0.5", "iters": 5, "warmup": 2, "case_seconds": 10.0}
QUICK["warmup_seconds"] = 5.0


def add_args(p) -> None:
    p.add_argument("--sizes-gib", default="1,8,36", help="table sizes, GiB of float32")
    p.add_argument("--dim", type=int, default=128, help="row width E")
    p.add_argument("--dir", default="/work/bigtables", help="where the tables are created")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--zipf-a", type=float, default=1.1)
    p.add_argument("--threads", default="2,8", help="gather threads to compare")
    p.add_argument("--warmup", type=int, default=20, help="warm-up steps, at least")
    p.add_argument("--warmup-seconds", type=float, default=60.0, help="...then until 99%% hits")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--case-seconds", type=float, default=40.0)
    p.add_argument("--cold", action="store_true", help="start from an empty page cache")
    p.add_argument("--quick", action="store_true", help="small tables, a minute")
    p.add_argument("--json", default=None)


def resident(arr: np.ndarray) -> np.ndarray:
    """uint8 [pages]: 1 where the page of `arr`'s (page-aligned) mapping is in RAM."""
    n = -(-arr.nbytes // PAGE)
    vec = np.zeros(n, np.uint8)
    rc = _LIBC.mincore(
        ctypes.c_void_p(arr.ctypes.data),
        ctypes.c_size_t(arr.nbytes),
        vec.ctypes.data_as(ctypes.c_void_p),
    )
    if rc != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return vec & 1


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class Ids:
    """Step ids: zipf ranks through a fixed affine permutation of the rows, or uniform."""

    def __init__(self, rows: int, a: float, seed: int = 0):
        self.rows, self.a, self.rng = rows, a, np.random.default_rng(seed)
        mult = next_prime_above(int(rows * 0.6180339887))
        self.mult = mult if rows % mult else next_prime_above(mult)
        self.add = int(self.rng.integers(rows))

    def ranks(self, n: int) -> np.ndarray:
        out = np.empty(0, np.int64)
        while out.size < n:
            r = self.rng.zipf(self.a, 2 * n)
            out = np.concatenate([out, r[r <= self.rows] - 1])
        return out[:n]

    def draw(self, dist: str, n: int) -> np.ndarray:
        if dist == "uniform":
            return self.rng.integers(0, self.rows, n)
        return (self.ranks(n).astype(np.uint64) * np.uint64(self.mult) + np.uint64(self.add)) % (
            np.uint64(self.rows)
        )


def materialise(t: TableFile, chunk: int = 1 << 18) -> float:
    block = np.random.default_rng(1).standard_normal((chunk, t.dim)).astype(np.float32)
    start = time.perf_counter()
    for a in range(0, t.num_rows, chunk):
        b = min(a + chunk, t.num_rows)
        t.update_rows(np.arange(a, b), block[: b - a] * 0.02)
    t.flush()
    return time.perf_counter() - start


def run_case(path, ids_gen, dist, n_ids, threads, args, size_row):
    t = TableFile(path, mode="r", threads=threads)  # shares the page cache with the others
    for _ in range(args.warmup):  # a fresh mapping minor-faults on its first touch of a page
        t.gather(ids_gen.draw(dist, n_ids))
    rows_per_page = max(1, PAGE // (t.dim * 4))
    times, hits, faults = [], [], []
    deadline = time.perf_counter() + args.case_seconds
    for _ in range(args.iters):
        ids = ids_gen.draw(dist, n_ids).astype(np.int64)
        res = resident(t.data)
        hits.append(float(res[ids // rows_per_page].mean()))
        f0 = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        t.gather(ids)
        times.append(time.perf_counter() - start)
        f1 = resource.getrusage(resource.RUSAGE_SELF)
        faults.append((f1.ru_majflt - f0.ru_majflt, f1.ru_minflt - f0.ru_minflt))
        if time.perf_counter() > deadline and len(times) >= 3:
            break
    t.close()
    sec = float(np.median(times))
    return {
        **size_row,
        "dist": dist,
        "threads": threads,
        "steps": len(times),
        "ms_per_step": sec * 1e3,
        "rows_per_s": n_ids / sec,
        "tokens_per_s": n_ids / args.heads / sec,
        "id_hit_rate": float(np.mean(hits)),
        "majflt_per_step": float(np.mean([f[0] for f in faults])),
        "minflt_per_step": float(np.mean([f[1] for f in faults])),
    }


def bench_size(gib: float, args) -> list[dict]:
    rows = int(gib * 2**30) // (args.dim * 4)
    path = os.path.join(args.dir, f"table_{gib:g}gib")
    shutil.rmtree(path, ignore_errors=True)
    n_ids = args.batch * args.seq * args.heads
    gen = Ids(rows, args.zipf_a)
    start = time.perf_counter()
    t = create_table_file(path, rows, args.dim, seed=0, threads=2)
    info = {"table_gib": gib, "rows": rows, "create_s": time.perf_counter() - start}
    start = time.perf_counter()
    t.gather(gen.draw("zipf", n_ids))
    info["untouched_rows_per_s"] = n_ids / (time.perf_counter() - start)
    info["materialise_s"] = materialise(t)
    info["materialise_gb_per_s"] = rows * args.dim * 4 / info["materialise_s"] / 1e9
    info["allocated_gib"] = t.allocated_bytes() / 2**30
    t.close()  # unmapped: DONTNEED only drops pages no process maps
    if args.cold:
        drop_cache(os.path.join(path, "data.bin"))
    t = TableFile(path, mode="r", threads=max(int(x) for x in args.threads.split(",")))
    out = []
    size_row = {"table_gib": gib, "path": "file"}
    rows_per_page = max(1, PAGE // (args.dim * 4))
    for dist in ("zipf", "uniform"):
        start, steps, hit = time.perf_counter(), 0, 0.0
        while steps < args.warmup or (
            hit < 0.99 and time.perf_counter() - start < args.warmup_seconds
        ):
            ids = gen.draw(dist, n_ids)
            hit = float(resident(t.data)[ids // rows_per_page].mean())
            t.gather(ids)
            steps += 1
        warm = {"warmup_steps": steps, "warmup_s": time.perf_counter() - start}
        for threads in [int(x) for x in args.threads.split(",")]:
            row = run_case(path, gen, dist, n_ids, threads, args, size_row)
            out.append({**row, **warm})
        if dist == "zipf":
            cached = int(resident(t.data).sum()) * rows_per_page
            for r in out[-len(args.threads.split(",")) :]:
                r["ideal_row_cache_hit_rate"] = float(np.mean(gen.ranks(1 << 20) < cached))
    if gib <= 1:  # an in-RAM copy: kept small on a shared machine
        host = HostTable(np.array(t.data), threads=2)
        ids = gen.draw("zipf", n_ids)
        host.gather(ids[:, None])
        start = time.perf_counter()
        for _ in range(5):
            host.gather(gen.draw("zipf", n_ids)[:, None])
        sec = (time.perf_counter() - start) / 5
        out.append(
            {
                **size_row,
                "path": "in_ram",
                "dist": "zipf",
                "threads": 2,
                "rows_per_s": n_ids / sec,
                "tokens_per_s": n_ids / args.heads / sec,
                "ms_per_step": sec * 1e3,
            }
        )
        host.close()
        del host
    t.close()
    shutil.rmtree(path)
    print(info)
    return [dict(r, **{"setup": info}) for r in out]


def run(args) -> int:
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    os.makedirs(args.dir, exist_ok=True)
    rows = []
    for gib in [float(s) for s in args.sizes_gib.split(",")]:
        rows += bench_size(gib, args)
        print(format_table(rows[-1:], ["table_gib", "dist", "rows_per_s"]))
    cols = ["table_gib", "path", "dist", "threads", "steps", "ms_per_step", "rows_per_s"]
    cols += ["tokens_per_s", "id_hit_rate", "majflt_per_step", "minflt_per_step"]
    cols += ["ideal_row_cache_hit_rate"]
    print(format_table(rows, cols))
    load = os.getloadavg()
    write_json(
        args.json,
        {
            "rows": rows,
            "ids_per_step": args.batch * args.seq * args.heads,
            "shape": [args.batch, args.seq, args.heads],
            "dim": args.dim,
            "zipf_a": args.zipf_a,
            "cold": args.cold,
            "machine": {
                **machine_info(),
                "ram_gib": os.sysconf("SC_PHYS_PAGES") * PAGE / 2**30,
                "loadavg_at_end": load,
            },
        },
    )
    return 0
