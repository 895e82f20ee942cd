"""te_v2: Lightning Thunder linears in FP8 on TransformerEngine kernels, running only the GEMMs,
FP8 copies and state updates the backward really consumes.

    import thunder
    import te_v2_executor

    jitted = thunder.jit(model, executors=te_v2_executor.executors())
    compiled = te_v2_executor.thunderfx(model)  # through torch.compile's Dynamo
"""

from te_v2_executor.backends import Backend
from te_v2_executor.checkpoint import quantization_state_template
from te_v2_executor.config import ClaimPolicy, TEv2Config
from te_v2_executor.cuda_graphs import TEv2CUDAGraphTransform
from te_v2_executor.dynamo import TEv2Compiler, thunderfx
from te_v2_executor.executor import (
    TEv2Executor,
    TEv2FallbackWarning,
    TEv2PerformanceWarning,
    executors,
    make_te_v2,
    te_v2,
)
from te_v2_executor.fsdp import FP8GatheredWeight, fp8_all_gather
from te_v2_executor.grouped_attention import grouped_scaled_dot_product_attention
from te_v2_executor.inductor import inductor_ex
from te_v2_executor.passes.stale_reads import RefusedProgram
from te_v2_executor.recipes import RecipeSpec, Scaling, block_scaling, current_scaling, delayed_scaling
from te_v2_executor.report import LinearReport, Report, explain
from te_v2_executor.state import (
    LinearQuantState,
    StateKey,
    TEv2SharedStateWarning,
    load_quantization_state_dict,
    quantization_state_dict,
    quantization_update_scope,
)

__all__ = [
    "Backend",
    "ClaimPolicy",
    "FP8GatheredWeight",
    "LinearQuantState",
    "LinearReport",
    "RecipeSpec",
    "RefusedProgram",
    "Report",
    "Scaling",
    "StateKey",
    "TEv2CUDAGraphTransform",
    "TEv2Compiler",
    "TEv2Config",
    "TEv2Executor",
    "TEv2FallbackWarning",
    "TEv2PerformanceWarning",
    "TEv2SharedStateWarning",
    "block_scaling",
    "current_scaling",
    "delayed_scaling",
    "executors",
    "explain",
    "fp8_all_gather",
    "grouped_scaled_dot_product_attention",
    "inductor_ex",
    "load_quantization_state_dict",
    "make_te_v2",
    "quantization_state_dict",
    "quantization_state_template",
    "quantization_update_scope",
    "te_v2",
    "thunderfx",
]
