"""How close an accumulated run must come to its large-batch reference.

Both runs compute each update from the same numbers added in another order
(the large batch's gradient in one pass, or the micro-batch gradients summed
in float32), so they agree to float32 rounding, not bit for bit. A real bug
moves values by about a learning rate (1e-3..1e-1 here).

Mixed-precision tests round to float16 or bfloat16 and state their own,
measured tolerances beside the test.
"""

# Float32 rounding after a few cycles on the tests' small models: measured
# noise between equivalent runs is 3e-8..3e-7 absolute; relative 1e-5 covers
# values far from zero (Adam's second moments are ~1e-5 in size).
RTOL = 1e-5
ATOL = 1e-6

# Where two equivalent plain runs already differ by more than that (an
# ill-conditioned gradient component, see `state.rounding_floor`), the
# accumulated run may differ from the reference by this many times as much
# (measured ratios: 1.0 eagerly, where the two runs are bit-identical, and
# up to 1.5 under XLA, which fuses the two runs' graphs differently).
FLOOR_FACTOR = 4.0
