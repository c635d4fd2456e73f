"""`python -m v41jax.speculative.audit module:function ...`: the audit's command line.

Loads the verifier named by a `module:function` or `path/to/file.py:function` spec (a usage
error naming the spec when it is not of that form or names nothing), runs `audit_verifier`
and prints its summary (`--verbose`: every check).
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util  # also binds importlib.import_module
import os
from collections.abc import Sequence

from v41jax.speculative.audit import Verifier, audit_verifier

SPEC_FORM = "module:function or path/to/file.py:function"


def load_callable(spec: str) -> Verifier:
    """`package.module:function` or `path/to/file.py:function`; a ValueError naming `spec`
    when it is not of that form or names no module, file or function."""
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        mod, dot, fn = spec.rpartition(".")
        if spec.endswith(".py"):
            hint = f" (did you mean {spec}:FUNCTION?)"
        else:
            hint = f" (did you mean {mod}:{fn}?)" if dot and mod and fn else ""
        raise ValueError(f"verifier {spec!r}: expected {SPEC_FORM}{hint}")
    if target.endswith(".py"):
        if not os.path.isfile(target):
            raise ValueError(f"verifier {spec!r}: no file {target!r}")
        mod_spec = importlib.util.spec_from_file_location(f"_audited_{abs(hash(target))}", target)
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as e:
            missing = e.name or target
            if target == missing or target.startswith(f"{missing}."):
                raise ValueError(
                    f"verifier {spec!r}: no module named {missing!r} (expected {SPEC_FORM})"
                ) from None
            raise ValueError(f"verifier {spec!r}: importing {target!r} failed: {e}") from None
    fn = getattr(module, attr, None)
    if fn is None:
        names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
        close = difflib.get_close_matches(attr, names, n=3)
        hint = f" (did you mean {', '.join(f'{target}:{c}' for c in close)}?)" if close else ""
        raise ValueError(f"verifier {spec!r}: {target!r} has no attribute {attr!r}{hint}")
    if not callable(fn):
        raise ValueError(f"verifier {spec!r}: {attr!r} is a {type(fn).__name__}, not a function")
    return fn


DESCRIPTION = """\
Statistical audit: does a speculative verifier preserve the target distribution?

Runs the verifier on fixed target/draft tables (six cases: random drafts, random verify
lengths, target zeros, one-hot drafts, near-identical laws), G-tests the emitted tokens and the
acceptance counts against their exact laws, and decides by Bonferroni over all checks. Prints a
summary, one line per case (--verbose: every check). Exit status: 0 if the audit passes, 1 if
it fails, 2 on a usage error."""

EPILOG = (
    "example: python -m v41jax.speculative.audit v41jax.speculative.audit:reference_verifier"
    " --samples 20000"
)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry: print the report; return 0 if the verifier passes, 1 if not."""
    ap = argparse.ArgumentParser(
        prog="python -m v41jax.speculative.audit",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("verifier", help=SPEC_FORM)
    ap.add_argument("--samples", type=int, default=200_000, help="rows per case (200000)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the tables and draws (0)")
    ap.add_argument("--vocab", type=int, default=6, help="vocabulary size V >= 3 (6)")
    ap.add_argument("--k", type=int, default=3, help="drafts per row K >= 1 (3)")
    ap.add_argument("--alpha", type=float, default=1e-3, help="family-wise level (1e-3)")
    ap.add_argument(
        "--verbose", action="store_true", help="list every check, and observed/expected tables"
    )
    ap.add_argument(
        "--detail",
        choices=["failed", "all"],
        default=None,
        help="with --verbose (implies it): tables of failed checks only, or of all (default)",
    )
    ap.add_argument("--no-jit", action="store_true", help="call the verifier eagerly")
    args = ap.parse_args(argv)
    if args.samples < 1 or args.vocab < 3 or args.k < 1 or not 0 < args.alpha < 1:
        ap.error(
            f"need --samples >= 1, --vocab >= 3, --k >= 1 and 0 < --alpha < 1; got "
            f"{args.samples}, {args.vocab}, {args.k}, {args.alpha:g}"
        )
    try:
        verifier = load_callable(args.verifier)
    except ValueError as e:
        ap.error(str(e))
    report = audit_verifier(
        verifier,
        vocab_size=args.vocab,
        k=args.k,
        num_samples=args.samples,
        seed=args.seed,
        alpha=args.alpha,
        jit=not args.no_jit,
        name=args.verifier,
    )
    verbose = args.verbose or args.detail is not None
    print(report.format(args.detail or "all") if verbose else report.summary())
    return 0 if report.passed else 1
