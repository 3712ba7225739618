"""Stub of sgl_kernel for SGLang on CPU (tests only; there is no CPU wheel).

Python-level imports (``from sgl_kernel import ...``) get permissive stubs.
SGLang 0.5.2x also looks CPU ops up as ``torch.ops.sgl_kernel.<name>`` while
importing model modules (``fused_sigmoid_mul_cpu`` in models/qwen3_5.py,
reached from the Qwen-VL processor import, first). Those are registered here
with ``torch.library``. Without AMX, SGLang computes linear, norm, rotary and
attention layers in plain torch, so only the lookups must succeed: the ops a
tiny Qwen2-VL could reach get plain-torch bodies, the rest raise if called.
Never registered: ``convert_weight_packed`` (its presence means "AMX backend")
and anything SGLang probes with ``hasattr`` to choose a path.
"""
import _anything

_anything.install(__name__, __version__="0.3.21")


def _register_cpu_ops() -> None:
    try:
        import torch
    except ImportError:
        return
    ns = torch.ops.sgl_kernel
    lib = torch.library.Library("sgl_kernel", "FRAGMENT")
    _register_cpu_ops.lib = lib  # keep the registrations alive

    def define(schema, fn):
        name = schema.split("(", 1)[0]
        try:
            getattr(ns, name)
            return  # registered already (a real build, or a second import)
        except (AttributeError, RuntimeError):
            pass
        lib.define(schema)
        lib.impl(name, fn, "CompositeExplicitAutograd")

    def fused_sigmoid_mul(x, gate):
        x.mul_(torch.sigmoid(gate))

    def rmsnorm(x, weight, eps):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + eps)).to(x.dtype) * weight

    def unsupported(name):
        def fn(*args):
            raise NotImplementedError(f"sgl_kernel stub: {name} has no CPU body here")
        return fn

    define("fused_sigmoid_mul_cpu(Tensor(a!) x, Tensor gate) -> ()", fused_sigmoid_mul)
    define("rmsnorm_cpu(Tensor x, Tensor weight, float eps) -> Tensor", rmsnorm)
    # looked up at import by model modules a Qwen2-VL never runs
    for name in ("fused_qk_gemma_rmsnorm_cpu", "fused_qk_gemma_rmsnorm_with_gate_cpu",
                 "fused_gdn_gating_cpu", "fused_qkvzba_split_reshape_cat_contiguous_cpu",
                 "fused_moe_router_cpu", "fused_dual_residual_rmsnorm_cpu"):
        define(f"{name}(Tensor[] args) -> Tensor[]", unsupported(name))


_register_cpu_ops()
