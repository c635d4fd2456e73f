"""DSpark under load: the `dspark_deep` target (24 layers, d 384) and its main drafter
(`dspark`: K = 5, 3 blocks, Markov rank 32, the hidden-state confidence head), decoded by
continuous batching at rising concurrency.

The target, its own text and the drafter are `experiments/dspark_deep`'s (its config, its
training code, its runs dir by default: a finished run there is reused, a missing one is
trained here with the same settings). `QUICK` shrinks everything for the slow smoke test.
"""

# closed loop: this many requests always in flight. Measured in this order: the targets'
# ends (the top and 1) and the open loop's 64 first, so a run cut short has them.
CONCURRENCY = (256, 1, 64, 4, 16, 128)
# per closed-loop run: the requests measured, those that finish after the first c (the
# steady state; the c in flight at the end are cancelled). At temperature 1 a run's speed
# follows the text it samples (easy continuations accept more drafts): 6 requests at c = 1
# moved a decoder by 2x between passes, so the small loads decode enough to average it out.
REQUESTS = {1: 48, 4: 64, 16: 64, 64: 96, 128: 192, 256: 256}
PROMPT_LEN = 32
NEW_TOKENS = 48
# KV-cache and history slots per batch row (`with_context_len`): what a request needs,
# prompt 32 + 48 new + the drafter's slack 2K + 1 = 91, rounded up to 16. Every decode round
# reads the whole cache: at the target's max_seq_len (512) the cache, not the verified
# tokens, set a round's cost at 64 rows.
CONTEXT_LEN = 96
TEMPERATURE = 1.0
PASSES = 2  # interleaved: every decoder once per pass at a concurrency, order alternating
# Before its timed passes each decoder compiles every program a run can reach
# (`ContinuousBatcher.precompile`: refills at every row count, every verify width or packed
# size): a warm-up run met only some, and the scheduled decoders' timed runs compiled.
PRECOMPILE = True
DECODERS = ("plain", "fixed_L1", "fixed_L2", "fixed_L3", "fixed_L4", "fixed_L5",
            "scheduled_padded", "scheduled_ragged")  # fmt: skip
# The scheduled decoders also measure, as they serve, the throughput of their drafted
# segments and of plain runs, and turn drafting off while plain is faster
# (`v41jax.decode.gate.SpeculationGate`: its settings; None: the cost table alone decides).
# The cost table is measured on an isolated batch; under load, rows finish nearly every
# round and the loop pays for drafting more than the table says.
SPECULATION_GATE = dict(decay=0.7, probe_rounds=32, max_probe_rounds=256)
# Open loop: Poisson arrivals into OPEN_SLOTS slots at these fractions of plain decoding's
# closed-loop request rate at that concurrency, OPEN_REQUESTS requests each.
OPEN_SLOTS = 64
OPEN_RATES = (0.5, 0.9)
OPEN_REQUESTS = 160
# the round-cost tables (padded widths, ragged packed sizes) of every concurrency
COST_ROUNDS = 4
COST_PASSES = 2
RAGGED_SIZES = 12  # packed sizes timed (all up to 8, then spread evenly in log over the rest)
SEED = 0

QUICK = dict(
    CONCURRENCY=(1, 3),
    REQUESTS={1: 2, 3: 4},
    PROMPT_LEN=8,
    NEW_TOKENS=6,
    CONTEXT_LEN=32,
    PASSES=1,
    DECODERS=("plain", "fixed_L2", "scheduled_padded", "scheduled_ragged"),
    OPEN_SLOTS=3,
    OPEN_RATES=(0.5,),
    OPEN_REQUESTS=4,
    COST_ROUNDS=1,
    COST_PASSES=1,
    RAGGED_SIZES=2,
)
