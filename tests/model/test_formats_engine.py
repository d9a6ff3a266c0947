"""Every weight format through the whole engine: it serves the format asked for, a seed's tokens do not
depend on who shares the batch, blocks return to the pool, and the model still answers sensibly."""

from __future__ import annotations

import pytest
import torch

from tailserve.config import CacheConfig, EngineConfig, ModelConfig
from tailserve.engine import LLM, SamplingParams
from tailserve.model.linear import Linear, WeightSource
from tailserve.model.plans import build_model, plan_for
from tailserve.weights.formats import VnniInt4
from tailserve.weights.loader import LoadedModel, load_model

FORMATS = ["fp32", "bf16", "int4", "int8", "auto"]
CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=FORMATS)
def llm(request: pytest.FixtureRequest, smol: LoadedModel) -> LLM:
    config = EngineConfig(
        # An explicit format is forced: this file tests the engine serving it; the gate's verdicts are
        # tested in test_quality.py. `auto` goes through the gate (measured once, then cached).
        model=ModelConfig(
            model="default",
            weight_format=request.param,
            force_weight_format=request.param != "auto",
            device="cpu",
            max_model_len=256,
        ),
        cache=CacheConfig(kv_cache_memory_bytes=32 << 20),
    )
    return LLM(config=config, loaded=smol)


def test_engine_serves_the_format_asked_for(llm: LLM) -> None:
    asked = llm.engine.config.model.weight_format
    model = llm.engine.runner.model
    assert model.plan == plan_for(asked, CPU)
    assert model.embed.dtype == model.activation_dtype


def test_same_seed_same_output_regardless_of_batch(llm: LLM) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234)
    alone = llm.generate(["Once upon a time"], params)[0].token_ids
    batched = llm.generate(["Once upon a time", "The weather today", "In a distant land"], params)
    assert batched[0].token_ids == alone
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    one = llm.generate(["The capital of France is"], greedy)[0].token_ids
    crowd = llm.generate(["Name three colors:", "The capital of France is", "2 + 2 ="], greedy)
    assert crowd[1].token_ids == one


def test_blocks_return_to_the_pool_and_answers_make_sense(llm: LLM) -> None:
    system = [{"role": "system", "content": "You are a concise assistant. Answer briefly."}]
    questions = ["What is the capital of France?", "Name three primary colors.", "What is 2 + 2?"]
    prompts = [
        llm.tokenizer.apply_chat_template(system + [{"role": "user", "content": q}]) for q in questions
    ]
    outs = llm.generate(prompts * 2, SamplingParams(max_tokens=12, temperature=0.0))
    assert "Paris" in outs[0].text and outs[3].text == outs[0].text, outs[0].text
    stats = llm.engine.stats()
    assert stats.kv_blocks_used == 0
    assert stats.num_running == 0 and stats.num_waiting == 0


@pytest.mark.parametrize("fmt", ["bf16", "int4", "int8"])
def test_hf_style_float_weights_are_requantized(fmt: str) -> None:
    """No GGUF blocks (HF safetensors, dummy): int formats re-quantize the floats and still run."""
    loaded = load_model("dummy:tiny", torch.float32)
    assert not loaded.blocks
    ref = build_model(loaded, "fp32", CPU, 64)
    model = build_model(loaded, fmt, CPU, 64)
    assert model.plan == plan_for(fmt, CPU)
    w = loaded.weights["model.layers.0.mlp.down_proj.weight"]
    x = torch.randn(3, w.shape[1]).to(torch.bfloat16)
    got = model.layers[0].down(x, 3).float()
    want = ref.layers[0].down(x.float(), 3)
    assert ((got - want).norm() / want.norm()).item() < (0.15 if fmt == "int4" else 0.02)


def test_cpus_without_bf16_run_prompt_rows_on_a_float32_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the CPU has no bf16 arithmetic (torch's bf16 GEMM emulated, ~4.5x slower than float32),
    the int formats' dense copy for prompt rows is float32 under bf16 activations; the bf16 format
    (dense for decode too) and CPUs with bf16 keep bf16. Such prompt rows round by thread count, so
    the engine opens no prefill lane over them."""
    from tailserve.engine.llm_engine import make_lane
    from tailserve.executor.runner import ModelRunner
    from tailserve.kernels import cpu as cpu_kernels

    monkeypatch.setattr(cpu_kernels, "amx", lambda: None)
    monkeypatch.setattr(cpu_kernels, "vnni", lambda: None)  # the int8 dot-product kernels: tested below
    monkeypatch.setattr(cpu_kernels, "int8_dots", lambda: None)
    monkeypatch.setattr(cpu_kernels, "native_bf16", lambda: True)
    assert plan_for("int4", CPU).prefill == "bf16"
    monkeypatch.setattr(cpu_kernels, "native_bf16", lambda: False)
    assert [plan_for(f, CPU).prefill for f in ("int4", "int8", "bf16", "fp32")] == [
        "fp32w",
        "fp32w",
        "bf16",
        "fp32",
    ]
    # without int8 dot products (VNNI or AVX2), decode rows stay on torch's int4 kernel; with no tile matmuls
    # either (no AMX, no AVX512-BF16) the head is bf16
    assert plan_for("int4", CPU).decode == "int4"
    with monkeypatch.context() as patch:
        patch.setattr(cpu_kernels, "tile_matmuls", lambda: None)
        assert plan_for("int4", CPU).head == "bf16"
    loaded = load_model("dummy:tiny", torch.float32)
    model = build_model(loaded, "int4", CPU, 64)
    assert model.activation_dtype == torch.bfloat16
    assert {linear.weight.dtype for linear in model.prompt_linears() if linear.weight is not None} == {
        torch.float32
    }
    runner = ModelRunner(model, 16, 16, CPU, kv_dtype=torch.bfloat16, num_threads=2)
    assert make_lane(runner) is None
    fp32 = ModelRunner(build_model(loaded, "fp32", CPU, 64), 16, 16, CPU, num_threads=2)
    assert make_lane(fp32) is not None  # the rule is the float32 copy's, not the thread count's


def test_cpus_without_bf16_but_with_vnni_run_int4_prompt_rows_on_int8_dot_products(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With AVX512-VNNI and no bf16 arithmetic, int4's prompt rows run the file's groups times int8
    activations (`int4a8`): no dense copy is kept, int8 keeps the float32 copy, and since the kernel's
    sums are integers (its rows' bits the same at any thread count) the engine opens a prefill lane."""
    from tailserve.engine.llm_engine import make_lane
    from tailserve.executor.runner import ModelRunner
    from tailserve.kernels import cpu as cpu_kernels

    dots = cpu_kernels.int8_dots()
    if dots is None:
        pytest.skip(
            "the kernels here have no int8 dot products (neither AVX512-VNNI nor AVX2, or no compiler)"
        )
    monkeypatch.setattr(cpu_kernels, "vnni", lambda: dots)  # AVX2's products give VNNI's bits
    monkeypatch.setattr(cpu_kernels, "amx", lambda: None)
    monkeypatch.setattr(cpu_kernels, "native_bf16", lambda: False)
    monkeypatch.setattr(cpu_kernels, "tile_matmuls", lambda: None)  # no AMX, no AVX512-BF16
    assert [plan_for(f, CPU).prefill for f in ("int4", "int8", "bf16")] == ["int4a8", "fp32w", "bf16"]
    # decode rows on the same codes with int16 activations (torch's int4 kernel runs bf16 emulated
    # here), the q8 head on int8 dot products
    assert (plan_for("int4", CPU).decode, plan_for("int4", CPU).head) == ("int4a16", "q8")
    assert plan_for("int8", CPU).head == "int8"
    loaded = load_model("dummy:tiny", torch.float32)
    model = build_model(loaded, "int4", CPU, 64)
    linears = model.prompt_linears()
    assert all(linear.weight is None and linear.vnni4 is not None for linear in linears)
    assert all(linear.int4 is None and linear.amx4 is None for linear in linears)  # one form of each weight
    x = torch.randn(5, linears[0].in_features).to(torch.bfloat16)
    vnni = linears[0].vnni4
    assert vnni is not None
    mixed = linears[0](x, 3)  # 3 decode rows, 2 prompt rows
    assert torch.equal(mixed[:3], vnni.matmul(x[:3], wide=True)) and torch.equal(
        mixed[3:], vnni.matmul(x[3:])
    )
    assert not torch.equal(mixed[:3], vnni.matmul(x[:3]))
    head = model.lm_head
    assert isinstance(head.q8, VnniInt4) and head.q8.logits and head.refine_with is not None
    dense = build_model(loaded, "int8", CPU, 64)
    assert sum(map(Linear.weight_bytes, linears)) * 2 < sum(map(Linear.weight_bytes, dense.prompt_linears()))
    runner = ModelRunner(model, 16, 16, CPU, kv_dtype=torch.bfloat16, num_threads=2)
    assert make_lane(runner) is not None


def test_cpus_with_avx2_alone_run_int4_decode_rows_on_int8_dot_products(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without bf16 arithmetic or VNNI but with AVX2 (AMD Zen 3), int4's decode rows run the file's
    groups times int16-rounded activations on AVX2's int8 products (`int4a16`) and the head the q8
    groups, while prompt rows stay on the float32 copy (`fp32w`): a mixed step's decode rows are the
    int8 products' bits and its prompt rows the float32 GEMM's, and no prefill lane opens (the
    float32 copy rounds by thread count)."""
    import torch.nn.functional as F

    from tailserve.engine.llm_engine import make_lane
    from tailserve.executor.runner import ModelRunner
    from tailserve.kernels import cpu as cpu_kernels

    if cpu_kernels.int8_dots() is None:
        pytest.skip(
            "the kernels here have no int8 dot products (neither AVX512-VNNI nor AVX2, or no compiler)"
        )
    monkeypatch.setattr(cpu_kernels, "amx", lambda: None)
    monkeypatch.setattr(cpu_kernels, "vnni", lambda: None)
    monkeypatch.setattr(cpu_kernels, "native_bf16", lambda: False)
    monkeypatch.setattr(cpu_kernels, "tile_matmuls", lambda: None)
    int4, int8 = plan_for("int4", CPU), plan_for("int8", CPU)
    assert (int4.decode, int4.prefill, int4.head) == ("int4a16", "fp32w", "q8")
    assert (int8.decode, int8.prefill, int8.head) == ("int8", "fp32w", "int8")
    loaded = load_model("dummy:tiny", torch.float32)
    model = build_model(loaded, "int4", CPU, 64)
    linears = model.prompt_linears()
    assert all(
        linear.weight is not None and linear.weight.dtype == torch.float32 and linear.vnni4 is not None
        for linear in linears
    )
    assert all(linear.int4 is None and linear.amx4 is None for linear in linears)
    first = linears[0]
    assert first.weight is not None and first.vnni4 is not None
    x = torch.randn(5, first.in_features).to(torch.bfloat16)
    mixed = first(x, 3)  # 3 decode rows, 2 prompt rows
    bias = None if first.bias is None else first.bias.float()
    assert torch.equal(mixed[:3], first.vnni4.matmul(x[:3], wide=True))
    assert torch.equal(mixed[3:], F.linear(x[3:].float(), first.weight, bias).to(torch.bfloat16))
    assert isinstance(model.lm_head.q8, VnniInt4) and model.lm_head.refine_with is not None
    assert make_lane(ModelRunner(model, 16, 16, CPU, kv_dtype=torch.bfloat16, num_threads=2)) is None
    with pytest.raises(ValueError, match="unsupported kernel pair"):
        Linear(WeightSource(torch.randn(32, 64)), None, "int4a8", "fp32w")


def test_int8_dot_products_run_the_files_own_int4_groups(
    monkeypatch: pytest.MonkeyPatch, smol: LoadedModel
) -> None:
    """On a CPU with VNNI and no bf16 arithmetic the int4 model's every linear (decode rows included)
    runs the file's own Q4_1 groups as stored, never a re-quantization of their floats (which a
    file whose groups miss code 0 or 15 would not survive), and its head the file's Q8_0 groups."""
    import tailserve.model.linear as linear_module
    from tailserve.kernels import cpu as cpu_kernels
    from tailserve.weights.formats import int8_groups_from_blocks, pack_vnni_int8

    lib = cpu_kernels.int8_dots()
    if lib is None:
        pytest.skip(
            "the kernels here have no int8 dot products (neither AVX512-VNNI nor AVX2, or no compiler)"
        )
    monkeypatch.setattr(cpu_kernels, "vnni", lambda: lib)  # AVX2's products give VNNI's bits
    monkeypatch.setattr(cpu_kernels, "amx", lambda: None)
    monkeypatch.setattr(cpu_kernels, "native_bf16", lambda: False)
    monkeypatch.setattr(cpu_kernels, "tile_matmuls", lambda: None)

    def requantized(_: torch.Tensor) -> None:
        raise AssertionError("a linear re-quantized its weight instead of taking the file's groups")

    monkeypatch.setattr(linear_module, "int4_from_float", requantized)
    model = build_model(smol, "int4", CPU, 64)
    assert all(linear.decode_kernel == "int4a16" for linear in model.prompt_linears())
    head_groups = int8_groups_from_blocks(smol.blocks["model.embed_tokens.weight"])
    assert head_groups is not None and isinstance(model.lm_head.q8, VnniInt4)
    assert torch.equal(model.lm_head.q8.codes, pack_vnni_int8(head_groups, lib).codes)
