"""An analytic profile: a worker's step and transfer costs computed from a model's
config.json and an accelerator's stated speeds, for GPU-scale questions on a machine
that has no GPU. A model, and labelled as one (Profile.source "analytic", its
assumptions in `notes`), never a measurement.

Each step's time is a roofline: the larger of its compute (matmul FLOPs at a share of
the accelerator's peak, attention FLOPs at a lower share) and its memory traffic
(the weights read once a step, each decode's KV read, at a share of the memory
bandwidth), plus a fixed launch overhead. The profile's StepCost is the router's own
linear fit (latency_model.StepModel) of that roofline over the shapes serving sees,
so the simulator and the router forecast with the same kind of model the real
cluster fits from telemetry.

Transfers stream layer by layer during the forward pass (kv_transfer): what stays
exposed after the last layer is that layer's share of the bytes at the link's
bandwidth, plus a handshake latency.

A worker of tensor_parallel_size N (Megatron's split, engine/parallel/) divides the
FLOPs, the weights and the KV (by KV heads: replicated ones are read on each rank) N
ways, and adds its collectives after the roofline: 2 all-reduces a layer and one for
the embedding, each of [tokens, hidden] over the node's link between devices (NVLink
or PCIe: Accelerator.tp_link), as a ring (2 (N - 1) / N of the bytes from each device)
plus a fixed latency each, and the logits' gather to rank 0. Each rank sends its own
KV heads over its own NIC."""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.latency_model import StepModel, TransferCost
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.parallel.sharding import check_tensor_parallel
from pdserve.engine.step_shape import StepShape, StepTiming
from pdserve.sim.profile import Profile


@dataclass(frozen=True)
class Accelerator:
    name: str
    peak_flops: float  # dense bf16 matmul, per second
    memory_bytes_per_s: float  # HBM bandwidth
    memory_bytes: float
    link_bytes_per_s: float  # between two workers' GPUs (the KV transfer's link)
    link_latency_s: float
    tp_link: str  # what joins a node's devices: a tensor-parallel worker's collectives
    tp_link_bytes_per_s: float  # per device, one direction
    tp_link_latency_s: float  # one collective's fixed cost
    host_link_bytes_per_s: float = 64e9  # device <-> host memory, one direction (PCIe)


# Vendor datasheet figures (dense bf16; SXM parts). The link is one 400 Gb/s NIC
# per GPU (InfiniBand NDR / RoCE), as between nodes of a disaggregated cluster.
# Between a node's devices: NVLink 4 (H100/H200 SXM) is 900 GB/s a GPU in both
# directions, NVLink 3 (A100 SXM) 600 GB/s; the L40S has no NVLink: PCIe 4.0 x16,
# 64 GB/s both ways. A collective's fixed cost is of NCCL's small-message order.
# Device <-> host memory (swap, the host prefix tier): PCIe 5.0 x16 on H100/H200 SXM
# (64 GB/s each way), 4.0 x16 on A100 and L40S (32 GB/s).
ACCELERATORS = {
    "h100": Accelerator("NVIDIA H100 SXM 80GB", 989e12, 3.35e12, 80e9, 50e9, 1e-3,
                        "NVLink 4", 450e9, 10e-6),
    "h200": Accelerator("NVIDIA H200 SXM 141GB", 989e12, 4.8e12, 141e9, 50e9, 1e-3,
                        "NVLink 4", 450e9, 10e-6),
    "a100": Accelerator("NVIDIA A100 SXM 80GB", 312e12, 2.04e12, 80e9, 25e9, 1e-3,
                        "NVLink 3", 300e9, 10e-6, 32e9),
    "l40s": Accelerator("NVIDIA L40S 48GB", 362e12, 0.864e12, 48e9, 25e9, 1e-3,
                        "PCIe 4.0 x16", 32e9, 20e-6, 32e9),
}


@dataclass(frozen=True)
class Efficiency:
    """Shares of the peaks a serving engine reaches: what the analytic model assumes."""
    matmul: float = 0.6  # of peak FLOPs in the projections and MLP
    attention: float = 0.35  # of peak FLOPs in attention
    memory: float = 0.75  # of the memory bandwidth
    link: float = 0.8  # of the link's bandwidth
    step_overhead_s: float = 2e-3  # launches and scheduling per step (eager PyTorch, no graphs)
    gpu_memory_utilization: float = 0.9  # as the engine's flag
    activation_reserve_bytes: float = 4e9  # not for weights or KV
    # A new worker: process, device and process-group set-up, then its weights read
    # from a node's local disk (or page cache) at this rate.
    startup_fixed_s: float = 15.0
    weight_load_bytes_per_s: float = 2e9


# Public config.json values of models a profile can be built for by name.
NAMED_CONFIGS = {
    "llama-3-8b": {  # meta-llama/Meta-Llama-3-8B
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "max_position_embeddings": 8192, "tie_word_embeddings": False,
        "bos_token_id": 128000, "eos_token_id": 128001},
    "llama-3-70b": {  # meta-llama/Meta-Llama-3-70B
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 8192,
        "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "max_position_embeddings": 8192, "tie_word_embeddings": False,
        "bos_token_id": 128000, "eos_token_id": 128001},
    "qwen2-7b": {  # Qwen/Qwen2-7B
        "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584,
        "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "max_position_embeddings": 32768, "tie_word_embeddings": False,
        "bos_token_id": 151643, "eos_token_id": 151643},
}

BYTES_PER_PARAM = 2  # bf16 weights and KV


@dataclass(frozen=True)
class Roofline:
    """Seconds of one step of a shape on a worker of `tp` accelerators, by the
    analytic model."""
    model: ModelConfig
    accel: Accelerator
    eff: Efficiency
    tp: int = 1

    @property
    def layer_params(self) -> int:
        m = self.model
        attention = m.hidden_size * (m.q_size + 2 * m.kv_size) + m.q_size * m.hidden_size
        return m.num_layers * (attention + 3 * m.hidden_size * m.intermediate_size)

    @property
    def rank_layer_params(self) -> float:
        """One rank's share of layer_params: 1/tp of each, but its k/v projections'
        KV heads (replicated past Hkv ranks)."""
        m, n = self.model, self.tp
        kv = max(m.num_kv_heads // n, 1) * m.head_dim
        attention = m.hidden_size * (m.q_size / n + 2 * kv) + m.q_size / n * m.hidden_size
        return m.num_layers * (attention + 3 * m.hidden_size * m.intermediate_size / n)

    @property
    def weight_bytes(self) -> float:
        """The whole model's."""
        m = self.model
        embeddings = m.vocab_size * m.hidden_size * (1 if m.tie_word_embeddings else 2)
        return (self.layer_params + embeddings) * BYTES_PER_PARAM

    @property
    def rank_weight_bytes(self) -> float:
        m = self.model
        embeddings = m.vocab_size * m.hidden_size * (1 if m.tie_word_embeddings else 2)
        return (self.rank_layer_params + embeddings / self.tp) * BYTES_PER_PARAM

    @property
    def kv_bytes_per_token(self) -> int:
        """The whole worker's distinct KV of a token (what a transfer moves)."""
        return 2 * self.model.num_layers * self.model.kv_size * BYTES_PER_PARAM

    @property
    def rank_kv_bytes_per_token(self) -> int:
        """One rank's: its KV heads (at least one: replicated past Hkv ranks)."""
        m = self.model
        heads = max(m.num_kv_heads // self.tp, 1)
        return 2 * m.num_layers * heads * m.head_dim * BYTES_PER_PARAM

    def seconds(self, shape: StepShape) -> float:
        m, a, e, n = self.model, self.accel, self.eff, self.tp
        tokens = shape.prefill_tokens + shape.decode_seqs
        sampled = shape.decode_seqs + (1 if shape.prefill_tokens else 0)
        matmul = 2 * (self.rank_layer_params * tokens
                      + m.vocab_size * m.hidden_size * sampled / n)
        pairs = shape.prefill_pairs + shape.decode_context
        attention = 4 * m.num_layers * m.q_size * pairs / n
        compute = matmul / (a.peak_flops * e.matmul) + attention / (a.peak_flops * e.attention)
        traffic = self.rank_weight_bytes + self.rank_kv_bytes_per_token * (
            shape.decode_context + 2 * shape.prefill_tokens)
        memory = traffic / (a.memory_bytes_per_s * e.memory)
        return e.step_overhead_s + max(compute, memory) + self.collectives_s(tokens, sampled)

    def collectives_s(self, tokens: int, sampled: int) -> float:
        """A step's all-reduces (ring) and logits gather between the worker's ranks."""
        m, a, n = self.model, self.accel, self.tp
        if n == 1:
            return 0.0
        link = a.tp_link_bytes_per_s * self.eff.link
        all_reduce = a.tp_link_latency_s + 2 * (n - 1) / n * tokens * m.hidden_size \
            * BYTES_PER_PARAM / link
        gather = a.tp_link_latency_s + (n - 1) * sampled * -(-m.vocab_size // n) \
            * BYTES_PER_PARAM / link
        return (2 * m.num_layers + 1) * all_reduce + gather


def serving_shapes(max_model_len: int) -> list[StepShape]:
    """The shapes the fit weighs: prompts alone, decode batches of many sizes and
    contexts, and chunks beside decodes, within the context."""
    shapes = []
    for n in (16, 64, 256, 512, 1024, 2048, 4096, 8192):
        if n <= max_model_len:
            shapes.append(StepShape(prefill_tokens=n, prefill_pairs=n * (n + 1) // 2))
    for seqs in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        for context in (256, 1024, 4096):
            if context <= max_model_len:
                shapes.append(StepShape(decode_seqs=seqs, decode_context=seqs * context))
    for chunk in (256, 1024):
        for seqs in (8, 32, 128):
            shapes.append(StepShape(prefill_tokens=chunk, prefill_pairs=chunk * (chunk + 1) // 2,
                                    decode_seqs=seqs, decode_context=seqs * 1024))
    return shapes


def analytic_profile(model_name: str, config: dict, accelerator: str,
                     block_size: int = 16, eff: Efficiency = Efficiency(),
                     tensor_parallel_size: int = 1) -> Profile:
    """config: a config.json's contents (NAMED_CONFIGS, or a local file's); a worker
    of tensor_parallel_size accelerators."""
    if accelerator not in ACCELERATORS:
        raise ValueError(f"unknown accelerator {accelerator!r}: one of {sorted(ACCELERATORS)}")
    model = ModelConfig.from_hf_dict(config)
    check_tensor_parallel(model, tensor_parallel_size)
    accel, n = ACCELERATORS[accelerator], tensor_parallel_size
    roof = Roofline(model, accel, eff, n)
    fit = StepModel()
    fit.observe([StepTiming(shape=s, duration_s=roof.seconds(s), end_time=0.0)
                 for s in serving_shapes(model.max_position_embeddings)])
    kv_bytes_per_block = roof.kv_bytes_per_token * block_size
    kv_room = (accel.memory_bytes * eff.gpu_memory_utilization - roof.rank_weight_bytes
               - eff.activation_reserve_bytes)  # on each rank
    rank_block = roof.rank_kv_bytes_per_token * block_size
    if kv_room < rank_block:
        raise ValueError(f"{model_name} does not fit {n} x {accel.name} with room for KV "
                         f"(tensor_parallel_size {n})")
    # Each rank sends its own KV heads over its own NIC (replicas once).
    nics = min(n, model.num_kv_heads)
    transfer = TransferCost(
        latency_s=accel.link_latency_s,
        per_byte_s=1.0 / (accel.link_bytes_per_s * eff.link * model.num_layers * nics))
    devices = accel.name if n == 1 else f"{n} x {accel.name}"
    parallel = () if n == 1 else (
        f"tensor_parallel_size {n}: FLOPs, weights and KV heads split {n} ways (KV "
        f"heads replicated past {model.num_kv_heads} ranks); {2 * model.num_layers + 1} "
        f"all-reduces and a logits gather a step over {accel.tp_link} at "
        f"{accel.tp_link_bytes_per_s / 1e9:g} GB/s a device each way (ring), "
        f"{accel.tp_link_latency_s * 1e6:g} us each; rank 0's broadcast of each step "
        f"left out; KV sent over {nics} NICs; the weights read once, by one node",)
    return Profile(
        name=f"{model_name} on {devices} (analytic)", source="analytic",
        step_cost=fit.cost(), transfer_cost=transfer,
        num_kv_blocks=int(kv_room // rank_block), block_size=block_size,
        kv_bytes_per_block=kv_bytes_per_block, max_model_len=model.max_position_embeddings,
        vocab_size=model.vocab_size, tensor_parallel_size=n,
        host_copy_s_per_block=rank_block / (accel.host_link_bytes_per_s * eff.link),
        # A worker's ranks share one node (STRICT_PACK): its disk reads the model once.
        startup_s=eff.startup_fixed_s + roof.weight_bytes / eff.weight_load_bytes_per_s,
        notes=(f"a model, not a measurement: {accel.name} at {accel.peak_flops / 1e12:g} "
               f"TFLOPS bf16, {accel.memory_bytes_per_s / 1e12:g} TB/s, "
               f"{accel.memory_bytes / 1e9:g} GB",
               f"efficiencies: matmul {eff.matmul}, attention {eff.attention}, memory "
               f"{eff.memory}, link {eff.link}; {eff.step_overhead_s * 1e3:g} ms overhead "
               "per step",
               "step = overhead + max(compute, memory traffic) + collectives, fitted "
               "linearly over the shapes serving sees (latency_model.StepModel)",
               f"KV transfer over {accel.link_bytes_per_s * 8 / 1e9:g} Gb/s, layer by layer: "
               "the last layer's share exposed, plus the handshake",
               f"{roof.layer_params / 1e9:.2f}B layer parameters, bf16 weights and KV",
               f"device <-> host copies (swap, host prefix tier) at "
               f"{accel.host_link_bytes_per_s / 1e9:g} GB/s a device each way",
               *parallel,
               f"a new worker starts in {eff.startup_fixed_s:g} s of set-up plus its "
               f"weights read at {eff.weight_load_bytes_per_s / 1e9:g} GB/s"))
