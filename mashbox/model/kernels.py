"""Kernels: what a Decoder runs on, chosen once at its construction.

Six choices, each a field; "auto" (and kernel 0) picks the fastest that runs here:
- linears: bfloat16 dense linears on csrc's kernel ("csrc": model/linear.py's
  BF16Linear, with the norms, rope and activation in csrc too: model/row_ops.py), on
  oneDNN-packed weights ("onednn"), or plain F.linear ("torch"). float32 and CUDA never
  take "csrc".
- attention: decode rows (Batch.row_decode) on csrc's attention ("csrc":
  model/attention.py), prompt rows on its causal prefill kernel too where the model fits
  it (attention.prefill_supported; else SDPA for them), or both on SDPA ("sdpa"). "auto"
  takes csrc where the linears' kernel is AVX512-BF16 or named, and for weights gguf on
  the AVX2 kernel, where torch's bfloat16 is emulated and csrc's portable decode
  attention outruns SDPA (its prompt rows stay on SDPA there: see prefill).
- prefill: where attention "csrc" sends prompt rows: csrc's causal prefill kernel
  ("csrc", vdpbf16ps) or SDPA ("sdpa", masked and padded as the SDPA path's rows).
  "auto" takes SDPA on a CPU with AMX-BF16 tiles, where oneDNN's bfloat16 gemms under
  SDPA run on them and outrun the vdpbf16ps kernel (benchmarks/prefill.py --profile
  prints both), and where csrc's attention was taken for AVX2 gguf alone (the prefill
  kernel has no AVX2 path; its portable one is slower than SDPA), else csrc. Either keeps
  chunked prefill batch invariant.
- layers: a step whose rows all decode on csrc's attention runs every layer in one C
  call ("c": csrc/layers.c, model/layer_loop.py's CLayers) or the Python layer loop
  ("python"). "c" needs csrc linears and attention, dense or gguf weights, no q/k norms.
- prompt_linears: the GGUF linears' prompt rows (every row not flagged in
  Batch.row_decode) on AMX tiles ("amx": csrc/amx.c's tile rule), on vdpbf16ps lanes
  ("lanes": csrc/lanes.c's lanes rule, each output's blocks widened once per 512 rows
  instead of once per few rows) or on the decode rows' kernel ("same");
  benchmarks/quant.py measures them.
  "auto" takes amx for weights gguf on csrc's linears where the tiles run
  (native.amx_supported()) and the kernel is the AVX512-BF16 one, else lanes there and
  beside the AVX2 kernel (the lanes' AVX2 path, vdpbf16ps emulated), else same. A
  row's bits depend on its kind alone, so chunked prefill and batching stay invariant
  either way.
- kernel: which of csrc's kernels those run (native.KERNEL_AVX512BF16; native.KERNEL_AVX2:
  the linears on AVX2 and FMA, the other calls portable; or native.KERNEL_PORTABLE: plain
  C on any CPU, the same bits, slow: what the tests force on a machine without
  AVX512-BF16). 0: the fastest here; "auto" takes csrc only where that is the AVX512-BF16
  one, for weights gguf (which run on csrc's linears only), or where a kernel is named.

An explicit choice that cannot run here is a ModelError, not a silent fallback.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from mashbox import native
from mashbox.model import attention
from mashbox.model.errors import ModelError
from mashbox.model.linear import PROMPT_RULES
from mashbox.model.model_config import ModelConfig

LINEARS = ("auto", "csrc", "onednn", "torch")
ATTENTION = ("auto", "csrc", "sdpa")
PREFILL = ("auto", "csrc", "sdpa")
LAYERS = ("auto", "c", "python")
PROMPT_LINEARS = ("auto", *PROMPT_RULES)  # auto, amx, lanes, same
KERNELS = (0, native.KERNEL_PORTABLE, native.KERNEL_AVX512BF16, native.KERNEL_AVX2)


@dataclass(frozen=True)
class Kernels:
    linears: str = "auto"
    attention: str = "auto"
    layers: str = "auto"
    kernel: int = 0
    prefill: str = "auto"
    prompt_linears: str = "auto"

    def __post_init__(self) -> None:
        for name, value, allowed in (("linears", self.linears, LINEARS), ("attention", self.attention, ATTENTION),
                                     ("layers", self.layers, LAYERS), ("kernel", self.kernel, KERNELS),
                                     ("prefill", self.prefill, PREFILL),
                                     ("prompt_linears", self.prompt_linears, PROMPT_LINEARS)):
            if value not in allowed:
                raise ModelError(f"kernels.{name} must be one of {', '.join(map(str, allowed))}, not {value!r}")

    def resolve(self, config: ModelConfig, dtype: torch.dtype, device: torch.device, weights: str,
                packs: bool, amx: bool = False) -> "Kernels":
        """The concrete choice for this model, dtype and device (no "auto" left; kernel 0
        only where nothing runs on csrc). packs: oneDNN's linear packing is offered; amx:
        the CPU has AMX-BF16 tiles (device.amx_bf16())."""
        fastest = native.bf16_kernel() if native.NATIVE else 0
        if self.kernel == native.KERNEL_AVX512BF16 and fastest != native.KERNEL_AVX512BF16:
            raise ModelError("kernels.kernel AVX512-BF16 does not run on this CPU (or the extension is not built)")
        if self.kernel == native.KERNEL_AVX2 and not native.avx2_supported():
            raise ModelError("kernels.kernel AVX2 does not run on this CPU (or the extension is not built)")
        if self.kernel and not native.NATIVE:
            raise ModelError("kernels.kernel needs the C extension (mashbox._native), which is not built")
        kernel = self.kernel or fastest
        # "auto" takes csrc where its kernel is the fast one, or where the caller named one
        auto_csrc = bool(self.kernel) or fastest == native.KERNEL_AVX512BF16
        csrc_linears = native.NATIVE and device.type == "cpu" and dtype == torch.bfloat16
        linears = self.linears
        if linears == "auto":
            # weights "gguf" (QuantLinear) run on csrc only; on an AVX2 CPU without AVX-512
            # oneDNN's bfloat16 packing refuses to run, and csrc's AVX2 linears do
            linears = ("csrc" if csrc_linears and (packs and (auto_csrc or weights == "gguf")
                                                   or fastest == native.KERNEL_AVX2)
                       else "onednn" if packs else "torch")
        elif linears == "csrc" and not csrc_linears:
            raise ModelError("kernels.linears csrc needs bfloat16 on the CPU with the C extension built")
        elif linears != "csrc" and weights == "gguf":
            raise ModelError("weights gguf runs on csrc's linears (kernels.linears csrc)")
        elif linears == "onednn" and not packs:
            raise ModelError("kernels.linears onednn needs a CPU with oneDNN's linear packing")
        csrc_attention = attention.supported(config, dtype, device)
        # GGUF blocks on the AVX2 kernel: torch's bfloat16 is emulated on such a CPU, and
        # csrc's decode attention (portable C there) outruns SDPA's (benchmarks/quant.py)
        avx2_gguf = kernel == native.KERNEL_AVX2 and linears == "csrc" and weights == "gguf"
        att = self.attention
        if att == "auto":
            att = "csrc" if csrc_attention and (auto_csrc or avx2_gguf) else "sdpa"
        elif att == "csrc" and not csrc_attention:
            raise ModelError("kernels.attention csrc needs bfloat16 on the CPU with the C extension built, "
                             f"head_dim a multiple of 16 up to {attention.MAX_HEAD_DIM} and at most "
                             f"{attention.MAX_GROUP} query heads per K/V head")
        prefill = self.prefill
        csrc_prefill = att == "csrc" and attention.prefill_supported(config)
        if prefill == "auto":
            # not for avx2_gguf alone: csrc's prefill kernel has no AVX2 path, and its
            # portable one is slower than SDPA there
            prefill = "csrc" if csrc_prefill and not amx and auto_csrc else "sdpa"
        elif prefill == "csrc" and not csrc_prefill:
            raise ModelError("kernels.prefill csrc needs attention csrc and at most "
                             f"{attention.PREFILL_MAX_GROUP} query heads per K/V head "
                             f"(group * head_dim up to {attention.PREFILL_MAX_GROUP_DIM})")
        c = config
        even = all(k % 2 == 0 for k in (c.hidden_size, c.q_size, c.intermediate_size))  # every linear's input size
        in_c = linears == "csrc" and att == "csrc" and weights in ("dense", "gguf") and not c.qk_norm and even
        layers = self.layers
        if layers == "auto":
            layers = "c" if in_c else "python"
        elif layers == "c" and not in_c:
            raise ModelError("kernels.layers c needs csrc linears and attention, dense or gguf weights, no q/k norms "
                             "and even layer widths")
        gguf = linears == "csrc" and weights == "gguf"
        # a rule with a kernel of its own runs on the GGUF linears beside these decode kernels
        beside = {"amx": (native.KERNEL_AVX512BF16,), "lanes": (native.KERNEL_AVX512BF16, native.KERNEL_AVX2)}
        runs = {rule: kernel_fn is None or gguf and kernel in beside[rule] and supported()
                for rule, (supported, kernel_fn) in PROMPT_RULES.items()}
        prompt_linears = self.prompt_linears
        if prompt_linears == "auto":
            prompt_linears = next(rule for rule in PROMPT_RULES if runs[rule])
        elif not runs[prompt_linears]:
            need = ("the AVX512-BF16 kernel and a CPU with AMX-BF16 tiles that the OS lets this process use"
                    if prompt_linears == "amx" else "the AVX512-BF16 or AVX2 kernel on a CPU that runs it")
            raise ModelError(f"kernels.prompt_linears {prompt_linears} needs weights gguf on csrc's linears, {need}")
        uses_csrc = linears == "csrc" or att == "csrc"
        return replace(self, linears=linears, attention=att, layers=layers, kernel=kernel if uses_csrc else 0,
                       prefill=prefill, prompt_linears=prompt_linears)
