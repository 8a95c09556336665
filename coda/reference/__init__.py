"""Pure-torch references: the canonical math and CODA's reparameterization of every kernel.

These are the only references in coda: kernels, tests, benchmarks and demos import them and
never re-type them. Nothing here imports quack or cutlass.
"""

from coda.reference.cross_entropy import (  # noqa: F401
    ce_from_stats_ref,
    cross_entropy_ref,
    dlogits_ref,
    linear_cross_entropy_ref,
    lse_combine_ref,
    lse_partials_ref,
)
from coda.reference.rmsnorm import (  # noqa: F401
    final_norm_ref,
    gemm_residual_rms_ref,
    gemm_residual_rms_torch,
    norm_bwd_apply_ref,
    norm_corr_ref,
    norm_stat_ref,
    rmsnorm_bwd_ref,
    rmsnorm_ref,
    rstd_from_partials_ref,
    rstd_ref,
    sumsq_partials_ref,
    wgrad_gamma_rows_ref,
)
from coda.reference.rope import (  # noqa: F401
    gemm_rope_ref,
    rope_adjacent_bwd_ref,
    rope_adjacent_ref,
    rope_hf_ref,
    rope_table,
)
from coda.reference.swiglu import (  # noqa: F401
    dswiglu_ref,
    geglu_ref,
    gemm_swiglu_ref,
    interleave_gate_up,
    split_gate_up,
    swiglu_ref,
)
