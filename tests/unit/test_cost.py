"""Cost model: Table 8 prices, Eq. 8, Alg. 1, and FLOPs of real architectures (App. E.2)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from policies.cost import (
    PAPER_LAMBDA_DEVICE_CONSTRAINED,
    PAPER_LAMBDA_SERVER_CONSTRAINED,
    QWEN2_5_0_5B,
    QWEN2_5_1_5B,
    SMOLLM2_135M,
    CostModel,
    DeviceEnergy,
    ModelArch,
    TokenPrices,
    cloud_prices,
    constrained_side,
    decode_flops_per_token,
    flops_breakdown,
    prefill_flops,
    usd_per_pflop,
)

ROOT = Path(__file__).resolve().parents[2]

# Qwen2.5-0.5B by hand: d = 896, 14 heads × head_dim 64 (q_dim 896), 2 KV heads (kv_dim 128),
# FFN 4864 (SwiGLU: 3 matrices), 24 layers, vocab 151936.
#   projections per layer per token (MACs): Q 896·896 + K,V 2·896·128 + O 896·896
#     = 802,816 + 229,376 + 802,816 = 1,835,008
#   FFN per layer per token (MACs): 3·896·4864 = 13,074,432
#   attention over ctx positions (MACs): 2·896·ctx  (QKᵀ and A·V over all heads)
#   norms: 4·896 FLOPs each, 2 per layer + final = 49 norms → 175,616 FLOPs per token
#   LM head (MACs): 896·151936 = 136,134,656 per logits position
# Decode, empty cache (ctx = 1: the token attends to itself):
#   layers: 24·(1,835,008 + 13,074,432 + 1,792) = 357,869,568 MACs
#   total FLOPs = 2·(357,869,568 + 136,134,656) + 175,616 = 988,184,064
QWEN_DECODE_FLOPS_CTX0 = 988_184_064
# Prefill of 3 tokens: 3 token positions, 1+2+3 = 6 attention pairs, logits for the last one:
#   attn = 2·24·(3·1,835,008 + 2·896·6) = 48·5,515,776 = 264,757,248
#   ffn  = 2·24·3·13,074,432            = 1,882,718,208
#   ln   = 175,616·3                    = 526,848
#   out  = 2·136,134,656                = 272,269,312
#   total                               = 2,420,271,616
QWEN_PREFILL3_FLOPS = 2_420_271_616


def test_table8_prices_convert_to_per_token():
    p = cloud_prices("gpt-4o-mini")
    assert p.prefill == pytest.approx(0.15e-6)
    assert p.decode == pytest.approx(0.60e-6)
    assert cloud_prices("command") == TokenPrices.per_million(1.25, 2.00)
    with pytest.raises(KeyError, match="known"):
        cloud_prices("no-such-model")


def test_qwen_decode_flops_match_hand_computation():
    assert decode_flops_per_token(QWEN2_5_0_5B) == QWEN_DECODE_FLOPS_CTX0
    # Each extra cached position adds QKᵀ + A·V: 2 FLOPs · 2 · 896 · 24 layers = 86,016.
    assert decode_flops_per_token(QWEN2_5_0_5B, context=10) - QWEN_DECODE_FLOPS_CTX0 == 10 * 86_016


def test_qwen_prefill_flops_match_hand_computation():
    parts = flops_breakdown(QWEN2_5_0_5B, 3, 6, 1)
    assert parts == {"attn": 264_757_248, "ffn": 1_882_718_208, "ln": 526_848, "emb": 0, "out": 272_269_312}
    assert prefill_flops(QWEN2_5_0_5B, 3) == QWEN_PREFILL3_FLOPS
    assert prefill_flops(QWEN2_5_0_5B, 0) == 0


def test_prefill_attention_is_quadratic():
    # pairs(2n) − 2·pairs(n) = n², and doubling the prompt adds no second LM head, so
    # prefill(2n) − 2·prefill(n) = 2 FLOPs · 2 · q_dim · n_layers · n² − one head.
    a, n = QWEN2_5_0_5B, 100
    head = 2 * a.hidden * a.vocab
    assert prefill_flops(a, 2 * n) - 2 * prefill_flops(a, n) == 4 * 896 * 24 * n * n - head


def test_embedding_as_matmul_and_non_gated_ffn():
    a = QWEN2_5_0_5B
    base = decode_flops_per_token(a)
    assert decode_flops_per_token(a, embedding_as_matmul=True) - base == 2 * 896 * 151936
    plain = ModelArch(24, 896, 4864, 14, 2, 151936, gated_ffn=False)
    assert base - decode_flops_per_token(plain) == 2 * 24 * 896 * 4864  # one FFN matrix fewer
    assert ModelArch.gated_for("qwen2") and not ModelArch.gated_for("bloom")


def test_model_arch_validates():
    with pytest.raises(ValueError):
        ModelArch(0, 896, 4864, 14, 2, 151936)
    with pytest.raises(ValueError, match="multiple"):
        ModelArch(24, 896, 4864, 14, 3, 151936)


def test_eq8_total_cost():
    # server: 100 prompt tokens · 0.15 $/M + 50 generated · 0.60 $/M = 1.5e-5 + 3.0e-5 = 4.5e-5
    # device: λ = 0.3 $/PFLOP = 3e-16 $/FLOP; (200 · 1e9 + 10 · 2e9) FLOPs = 2.2e11 → 6.6e-5
    model = CostModel(cloud_prices("gpt-4o-mini"), DeviceEnergy(1e9, 2e9), usd_per_pflop(0.3))
    assert model.total(100, 50, 200, 10) == pytest.approx(4.5e-5 + 6.6e-5)
    assert model.device == TokenPrices(pytest.approx(3e-7), pytest.approx(6e-7))
    assert model.prices("cloud") is model.server


def test_alg1_constrained_side_with_paper_lambdas():
    energy = DeviceEnergy.from_arch(QWEN2_5_0_5B)
    server = cloud_prices("gpt-4o-mini")
    # λ = 0.3: device ≈ 0.22 / 0.30 $/M < server max 0.60 → the server is the constrained side.
    cheap = CostModel(server, energy, usd_per_pflop(PAPER_LAMBDA_SERVER_CONSTRAINED))
    assert cheap.device.prefill * 1e6 == pytest.approx(0.217, abs=1e-3)
    assert cheap.constrained_side() == "server"
    # λ = 5: device ≈ 3.6 / 5.0 $/M > 0.60 → device-constrained.
    dear = CostModel(server, energy, usd_per_pflop(PAPER_LAMBDA_DEVICE_CONSTRAINED))
    assert dear.constrained_side() == "device"
    assert dear.constrained_side(override="server") == "server"


def test_alg1_is_a_strict_inequality_on_min_vs_max():
    server = TokenPrices(1.0, 3.0)
    assert constrained_side(server, TokenPrices(3.0, 9.0)) == "server"  # min(device) == max(server): not >
    assert constrained_side(server, TokenPrices(3.5, 9.0)) == "device"
    assert constrained_side(server, TokenPrices(9.0, 2.9)) == "server"  # the min counts
    with pytest.raises(ValueError):
        constrained_side(server, server, override="both")  # type: ignore[arg-type]


def test_device_energy_from_arch_is_per_token_at_reference():
    e = DeviceEnergy.from_arch(SMOLLM2_135M, ref_prompt=64, ref_context=32)
    assert e.prefill_per_token == pytest.approx(prefill_flops(SMOLLM2_135M, 64) / 64)
    assert e.decode_per_token == decode_flops_per_token(SMOLLM2_135M, 32)
    assert e.prefill_exact(10) == prefill_flops(SMOLLM2_135M, 10)
    assert DeviceEnergy(5.0, 7.0).prefill_exact(10) == 50.0


def _bundled_path(name: str) -> Path:
    out = subprocess.run(
        [sys.executable, "-m", "deploy.models", "path", name], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return Path(out.stdout.strip())


@pytest.fixture(scope="module")
def qwen_gguf() -> Path:
    path = _bundled_path("qwen2.5-coder-0.5b-instruct")
    if not path.exists():
        pytest.skip(f"bundled model not fetched: {path} (python -m deploy.models fetch)")
    return path


@pytest.mark.slow
def test_read_arch_of_real_qwen_gguf(qwen_gguf: Path):
    from clients.gguf_meta import read_arch

    arch = read_arch(qwen_gguf)
    assert arch == QWEN2_5_0_5B
    assert arch.name == "qwen2" and arch.hd == 64
    assert decode_flops_per_token(arch) == QWEN_DECODE_FLOPS_CTX0
    assert prefill_flops(arch, 3) == QWEN_PREFILL3_FLOPS
    assert read_arch(str(qwen_gguf)) is arch  # cached per (path, size, mtime)


@pytest.mark.slow
def test_read_arch_of_real_smollm_gguf():
    from clients.gguf_meta import read_arch

    path = _bundled_path("smollm2-135m-instruct")
    if not path.exists():
        pytest.skip(f"bundled model not fetched: {path}")
    assert read_arch(path) == SMOLLM2_135M


def test_read_arch_rejects_non_gguf(tmp_path: Path):
    from clients.gguf_meta import GGUFMetaError, read_arch

    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(GGUFMetaError):
        read_arch(bad)
    with pytest.raises(GGUFMetaError):
        read_arch(tmp_path / "missing.gguf")


def test_reference_arch_of_the_1_5b_is_consistent():
    # Same tokenizer as the 0.5B (shared vocabulary), wider and deeper.
    assert QWEN2_5_1_5B.vocab == QWEN2_5_0_5B.vocab
    assert decode_flops_per_token(QWEN2_5_1_5B) > 2.5 * decode_flops_per_token(QWEN2_5_0_5B)
