"""DiSCo's unified cost model (App. E, Eq. 8) and the device energy proxy (App. E.2).

Why one model for both sides: DiSCo trades server money against device energy.
Eq. 8 puts them on one scale with a user-set exchange rate λ:

    Total cost = c_s^p·l_s^p + c_s^d·l_s^d + λ·(c_d^p·l_d^p + c_d^d·l_d^d)         (Eq. 8)

(the paper writes one l_s and one l_d for both phases; prefill and decode token
counts differ, so they are separate arguments here).

Server prices come from the provider's list (Table 8, USD per million tokens,
converted to USD per token). Device "prices" are energy, proxied by FLOPs per
token of the device model's real architecture (Eqs. 9-11), times λ.

FLOP accounting (what we count, and where it departs from the paper's printout):

* 2 FLOPs per multiply-accumulate (the usual convention). The paper's Table 6/7
  numbers are consistent with counting one MAC as one FLOP and with a 768-wide
  "Qwen-0.5B"; we count the real model read from its GGUF instead.
* Attention projections use the real head layout: Q and O are d×(n_heads·head_dim),
  K and V are d×(n_kv_heads·head_dim) (grouped-query attention). Eq. 10 assumes
  multi-head attention (3d² + d²) and prints a dimensionally odd L²·d/n_heads term;
  we count QKᵀ and A·V exactly: 2·(n_heads·head_dim)·ctx MACs per token that
  attends to ctx positions. Summed over a prefill of l tokens this is the
  quadratic term; in decode it is linear in the context (Eq. 11 keeps it too),
  which is small next to the weights at chat lengths.
* FFN: gated (SwiGLU, three d×i matrices) for llama/qwen-style models, two
  matrices for classic GELU MLPs (BLOOM, GPT-2).
* Norms: 4·d FLOPs per RMS/LayerNorm (2 per layer + the final one). Tiny.
* Embedding: a table lookup, 0 FLOPs. The paper counts it like the output
  projection (Table 7: both 31.5%); pass `embedding_as_matmul=True` for that.
* Output projection (LM head): 2·d·V per position whose logits are computed:
  every decode step, but in prefill only the last position (llama.cpp computes
  logits for the last prompt token only). This is why a prefill token is cheaper
  than a decode token here, whereas the paper's Table 6 shows them nearly equal.

λ units: App. E sets λ = 0.3 and 5 "$ per million FLOPs" for server- and
device-constrained runs. Taken literally that makes one device token cost
hundreds of dollars. The reading that reproduces both regimes with Table 8
prices is "USD per million tokens per GFLOP/token", i.e. USD per 10^15 FLOPs
(PFLOP): 0.4 GFLOP/token × 0.3 = 0.12 $/Mtok (cheaper than GPT-4o-mini → server
constrained), × 5 = 2 $/Mtok (dearer → device constrained). `usd_per_pflop`
converts that to the USD-per-FLOP λ used below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Side = Literal["server", "device"]  # the paper's word for the two sides of a budget
SIDES: tuple[Side, ...] = ("server", "device")
Role = Literal["cloud", "device"]  # the gateway's word for an endpoint's part in a request


def role_of(side: Side) -> Role:
    """The endpoint role that plays a budget side: the paper's "server" is any cloud endpoint."""
    return "cloud" if side == "server" else "device"


# App. E: λ for the server-constrained and the device-constrained experiments, in USD per PFLOP (see module doc).
PAPER_LAMBDA_SERVER_CONSTRAINED = 0.3
PAPER_LAMBDA_DEVICE_CONSTRAINED = 5.0

# Table 8 (prices as of 2024-10-28): (input, output) USD per million tokens.
PRICE_TABLE_USD_PER_MTOK: dict[str, tuple[float, float]] = {
    "deepseek-v2.5": (0.14, 0.28),
    "gpt-4o-mini": (0.15, 0.60),
    "llama-3.1-70b-hyperbolic": (0.40, 0.40),
    "llama-3.1-70b-amazon": (0.99, 0.99),
    "command": (1.25, 2.00),
    "gpt-4o": (2.50, 10.0),
    "claude-3.5-sonnet": (3.00, 15.0),
    "o1-preview": (15.0, 60.0),
}


def usd_per_pflop(value: float) -> float:
    """λ given in USD per 10^15 FLOPs (the paper's App. E numbers) → USD per FLOP."""
    return value * 1e-15


@dataclass(frozen=True)
class TokenPrices:
    """Cost of one prompt (prefill) token and one generated (decode) token, in one currency.

    Providers bill two kinds of token at prices of their own (OpenAI, DeepSeek, Anthropic, Gemini): a prompt token
    read from their prompt cache (`cached`, often a tenth to a half of the input price) and a reasoning token (billed
    as output by all of them today, but kept apart so a price list that differs can say so). None: the prefill's
    (decode's) price."""

    prefill: float
    decode: float
    cached: float | None = None
    reasoning: float | None = None

    @classmethod
    def per_million(
        cls, input_price: float, output_price: float, cached: float | None = None, reasoning: float | None = None
    ) -> TokenPrices:
        """From a provider's price list (USD per 1M tokens, Table 8) to USD per token."""
        return cls(
            prefill=input_price / 1e6,
            decode=output_price / 1e6,
            cached=None if cached is None else cached / 1e6,
            reasoning=None if reasoning is None else reasoning / 1e6,
        )

    @property
    def cached_prefill(self) -> float:
        """The price of a prompt token the provider read from its cache."""
        return self.prefill if self.cached is None else self.cached

    @property
    def reasoning_decode(self) -> float:
        """The price of a reasoning token."""
        return self.decode if self.reasoning is None else self.reasoning

    def cost(
        self, prefill_tokens: float, decode_tokens: float, *, cached_tokens: float = 0, reasoning_tokens: float = 0
    ) -> float:
        """`prefill_tokens` prompt tokens, `cached_tokens` of them read from the provider's cache; `decode_tokens`
        generated tokens, `reasoning_tokens` of them reasoning (each part at its own price)."""
        return (
            self.prefill * (prefill_tokens - cached_tokens)
            + self.cached_prefill * cached_tokens
            + self.decode * (decode_tokens - reasoning_tokens)
            + self.reasoning_decode * reasoning_tokens
        )

    def scaled(self, factor: float) -> TokenPrices:
        return TokenPrices(
            self.prefill * factor,
            self.decode * factor,
            None if self.cached is None else self.cached * factor,
            None if self.reasoning is None else self.reasoning * factor,
        )


def cloud_prices(model: str) -> TokenPrices:
    """Table 8 prices of a named commercial model, USD per token."""
    try:
        inp, out = PRICE_TABLE_USD_PER_MTOK[model]
    except KeyError:
        raise KeyError(f"no price for {model!r}; known: {', '.join(PRICE_TABLE_USD_PER_MTOK)}") from None
    return TokenPrices.per_million(inp, out)


# --------------------------------------------------------------------------- FLOPs


_NON_GATED_ARCHS = frozenset({"gpt2", "bloom", "gptneox", "gptj", "falcon", "mpt", "starcoder", "phi2", "bert"})


@dataclass(frozen=True)
class ModelArch:
    """The shape of a decoder-only transformer, enough to count its FLOPs."""

    n_layers: int
    hidden: int
    intermediate: int
    n_heads: int
    n_kv_heads: int
    vocab: int
    head_dim: int | None = None  # None: hidden // n_heads
    gated_ffn: bool = True
    name: str = ""

    def __post_init__(self) -> None:
        for field in ("n_layers", "hidden", "intermediate", "n_heads", "n_kv_heads", "vocab"):
            if getattr(self, field) <= 0:
                raise ValueError(f"ModelArch.{field} must be positive, got {getattr(self, field)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")

    @property
    def hd(self) -> int:
        return self.head_dim if self.head_dim else self.hidden // self.n_heads

    @staticmethod
    def gated_for(arch_name: str) -> bool:
        """Whether an architecture (GGUF `general.architecture`) uses a gated (3-matrix) FFN."""
        return arch_name.lower() not in _NON_GATED_ARCHS


# Reference shapes (match the bundled GGUFs; tests check read_arch against them).
QWEN2_5_0_5B = ModelArch(
    n_layers=24, hidden=896, intermediate=4864, n_heads=14, n_kv_heads=2, vocab=151936, name="qwen2"
)
QWEN2_5_1_5B = ModelArch(
    n_layers=28, hidden=1536, intermediate=8960, n_heads=12, n_kv_heads=2, vocab=151936, name="qwen2"
)
SMOLLM2_135M = ModelArch(n_layers=30, hidden=576, intermediate=1536, n_heads=9, n_kv_heads=3, vocab=49152, name="llama")


def flops_breakdown(
    arch: ModelArch, tokens: int, attended: int, logits_positions: int, *, embedding_as_matmul: bool = False
) -> dict[str, float]:
    """Eq. 9's five components for `tokens` token positions.

    attended: number of (query position, key position) pairs over those tokens (each
    pair costs QKᵀ and A·V for every head); logits_positions: how many positions
    run the LM head.
    """
    q_dim = arch.n_heads * arch.hd
    d = arch.hidden
    proj_macs = d * q_dim + 2 * d * arch.n_kv_heads * arch.hd + q_dim * d
    ffn_macs = (3 if arch.gated_ffn else 2) * d * arch.intermediate
    return {
        "attn": 2.0 * arch.n_layers * (tokens * proj_macs + 2 * q_dim * attended),
        "ffn": 2.0 * arch.n_layers * tokens * ffn_macs,
        "ln": 4.0 * d * (2 * arch.n_layers + 1) * tokens,
        "emb": 2.0 * d * arch.vocab * tokens if embedding_as_matmul else 0.0,
        "out": 2.0 * d * arch.vocab * logits_positions,
    }


def prefill_flops(arch: ModelArch, length: int, *, embedding_as_matmul: bool = False) -> float:
    """FLOPs to prefill a prompt of `length` tokens and produce the first token (Eqs. 9-10).

    Position p (1-based) attends to p keys, so attention pairs total n(n+1)/2 — the
    quadratic term. Logits only for the last position.
    """
    if length <= 0:
        return 0.0
    pairs = length * (length + 1) // 2
    parts = flops_breakdown(arch, length, pairs, 1, embedding_as_matmul=embedding_as_matmul)
    return sum(parts.values())


def decode_flops_per_token(arch: ModelArch, context: int = 0, *, embedding_as_matmul: bool = False) -> float:
    """FLOPs to generate one token with a KV cache holding `context` earlier positions (Eqs. 9, 11).

    The new token attends to context + 1 positions; the weight terms are constant,
    which is why the paper treats decode cost as constant per token.
    """
    parts = flops_breakdown(arch, 1, context + 1, 1, embedding_as_matmul=embedding_as_matmul)
    return sum(parts.values())


@dataclass(frozen=True)
class DeviceEnergy:
    """Energy proxy of the device model: FLOPs per prefill token and per decode token.

    Eq. 8 is linear in token counts, so the policy layer needs per-token constants;
    `from_arch` takes them at a reference prompt length / context (prefill is mildly
    super-linear through attention). `prefill_exact` keeps the exact count for
    booking when the architecture is known.
    """

    prefill_per_token: float
    decode_per_token: float
    arch: ModelArch | None = None

    @classmethod
    def from_arch(cls, arch: ModelArch, *, ref_prompt: int = 128, ref_context: int = 128) -> DeviceEnergy:
        return cls(
            prefill_per_token=prefill_flops(arch, ref_prompt) / ref_prompt,
            decode_per_token=decode_flops_per_token(arch, ref_context),
            arch=arch,
        )

    def prefill_exact(self, length: int) -> float:
        return prefill_flops(self.arch, length) if self.arch is not None else self.prefill_per_token * length


# --------------------------------------------------------------------------- Eq. 8 and Alg. 1


def constrained_side(server: TokenPrices, device: TokenPrices, override: Side | None = None) -> Side:
    """Alg. 1: device-constrained if min(c_d^p, c_d^d)·λ > max(c_s^p, c_s^d), else server-constrained.

    `device` must already be in money (λ applied). `override` lets the operator pin
    the side (e.g. on battery), since the price test is only a heuristic.
    """
    if override is not None:
        if override not in SIDES:
            raise ValueError(f"constrained side must be one of {SIDES}, got {override!r}")
        return override
    return "device" if min(device.prefill, device.decode) > max(server.prefill, server.decode) else "server"


@dataclass(frozen=True)
class CostModel:
    """Eq. 8 for one (cloud backend, device model) pair.

    server: USD per token; energy: device FLOPs per token; lam: USD per FLOP.
    """

    server: TokenPrices
    energy: DeviceEnergy
    lam: float

    @property
    def device(self) -> TokenPrices:
        """Device prices in money: λ·FLOPs per token."""
        return TokenPrices(self.lam * self.energy.prefill_per_token, self.lam * self.energy.decode_per_token)

    def server_cost(
        self, prefill_tokens: float, decode_tokens: float, *, cached_tokens: float = 0, reasoning_tokens: float = 0
    ) -> float:
        """What the cloud bills (TokenPrices.cost: cached and reasoning tokens are parts of the two counts)."""
        return self.server.cost(
            prefill_tokens, decode_tokens, cached_tokens=cached_tokens, reasoning_tokens=reasoning_tokens
        )

    def device_cost(self, prefill_tokens: float, decode_tokens: float) -> float:
        energy = self.energy.prefill_per_token * prefill_tokens + self.energy.decode_per_token * decode_tokens
        return self.lam * energy

    def total(self, server_prefill: float, server_decode: float, device_prefill: float, device_decode: float) -> float:
        """Eq. 8."""
        return self.server_cost(server_prefill, server_decode) + self.device_cost(device_prefill, device_decode)

    def prices(self, endpoint: Role) -> TokenPrices:
        return self.server if endpoint == "cloud" else self.device

    def constrained_side(self, override: Side | None = None) -> Side:
        return constrained_side(self.server, self.device, override)
