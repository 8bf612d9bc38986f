"""The model layer: weights in, logits out. torch lives here and in engine/runner.py only.

loader.py          load(path) -> LoadedWeights: HF safetensors folders and .gguf files
gguf_weights.py    one GGUF file as a ModelConfig and HF-named tensors (memory-mapped)
quants.py          GGML block formats -> torch tensors of the target dtype
fused_layout.py    q|k|v and gate|up loaded side by side, so fusing them is free
model_config.py    ModelConfig (frozen): one config for Llama, Mistral, Qwen2, Qwen3
rope.py            the rotary position table
decoder.py         Decoder.forward(Batch, KVCache): the varlen forward pass
kernels.py         Kernels: what a decoder runs on, chosen once at its construction
linear.py          the forms a linear weight takes (csrc's bf16 kernel, oneDNN, torch, int8/int4)
row_ops.py         norm, activation, rope + K/V write: csrc's or torch's
attention.py       decode rows' attention on csrc's kernel
attention_plan.py  AttentionPlan: one forward's attention, planned once, run by every layer
layer_loop.py      the layers of a forward: the Python loop, or one C call for a decode step
csrc.py            csrc's kernels on torch tensors: the checked boundary where tensors become addresses
kv_cache.py        KVCache: [layers, slots, kv_heads, ctx, head_dim] K and V, allocated once
device.py          device_and_dtype: the one place that picks cuda/cpu and the dtype
errors.py          ModelError
"""
