"""CODA's five epilogue primitive families, the vocabulary coda's kernels are written in.

- ``vocabulary``: the declarations (VEC / TILE / RED / LSE) and ``@epilogue_program``;
- ``math``: the EW vocabulary (pairs, transcendentals) with one meaning in every lowering;
- ``interpreter``: the torch lowering (CPU path, test oracle);
- ``lowering``: the quack SM90 lowering (GPU path);
- ``symbolic``: one element of a program on sympy values (the symbolic proofs);
- ``aux``: the fixed-order reductions over partials.
"""

from coda.primitives.math import (  # noqa: F401
    exp,
    exp2,
    expm1,
    gelu_tanh,
    gelu_tanh_gate,
    gelu_tanh_slope,
    pack,
    relu,
    select,
    sigmoid,
    silu,
    unpack,
    xielu,
    xielu_slope,
)
from coda.primitives.vocabulary import (  # noqa: F401
    ColLoad,
    ColPartials,
    ColSelect,
    DeviceScalar,
    EpilogueProgram,
    GroupRstd,
    OnlineLSE,
    RowLoad,
    RowPartials,
    Scalar,
    ScaleA,
    TileC,
    TileLoad,
    TileMaxLog2,
    TileStore,
    epilogue_program,
    group_fits,
)
