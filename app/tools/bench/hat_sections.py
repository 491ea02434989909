"""The sections of `tandem bench hat` (what each measures: app/tools/bench/hat.py), one coroutine each."""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from app.tools.bench.hat_setup import SD_ONLY, SD_PD, TABLE5, U_SHAPE, Bench, RawDevice, Variant, run_request, started
from app.tools.profiling.measure import median_ms
from clients.hat.ragged import rows_linear

REPEATS = 7  # timed calls per device component (after one untimed)

# A configuration of Tables 4 and 5: (its name in the results, the SD / PC / PD variant, further HATOptions).
Config = tuple[str, Variant, dict[str, Any]]


async def table5(bench: Bench) -> list[dict[str, Any]]:
    return await table5_rows(bench, [(v.name, v, {}) for v in TABLE5])


async def table5_rows(bench: Bench, configs: list[Config]) -> list[dict[str, Any]]:
    """Per prompt length, --table5-prompts code-reading prompts (different slices of the code), one greedy request
    per configuration and prompt, interleaved, after one warm-up request. One row per length and configuration: the
    medians over its prompts (TTFT, TBT, accept length), each prompt's own in `per_prompt`. The first configuration is
    the baseline whose tokens the others are checked against, prompt by prompt."""
    a = bench.args
    backends = {name: await started(bench, v, **kw) for name, v, kw in configs}
    await run_request(backends[configs[0][0]], bench.code_prompt(128), 4)  # warm-up
    rows = []
    for length in a.lengths:
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in configs}
        for index in range(a.table5_prompts):
            ids = bench.code_prompt(length, index)
            for name, _, _ in configs:
                r = await run_request(backends[name], ids, a.decode_tokens)
                runs[name].append(r)
                print(f"  table5 {length:5d} #{index} {name:9s} TTFT {r['ttft_ms']:8.0f} ms  TBT {r['tbt_ms']:6.1f} "
                      f"ms  accept {r['accept_length']:.2f}", file=sys.stderr)  # fmt: skip
        rows += summarize_table5(length, [(name, v) for name, v, _ in configs], runs)
    for b in backends.values():
        await b.close()
    return rows


def summarize_table5(length: int, configs: list[tuple[str, Variant]], runs: dict[str, list[dict[str, Any]]]):
    """One row per configuration at `length`: the medians over its prompts' requests (`runs[name]`, in prompt order);
    `differs_from_u_shape` when any prompt's tokens differ from the first configuration's."""
    base = runs[configs[0][0]]
    rows = []
    for name, v in configs:
        per_prompt = runs[name]
        row = {
            "prompt_tokens": length, "variant": name, "sd": v.sd, "pc": v.pc, "pd": v.pd,
            "prompts": len(per_prompt), "tokens": per_prompt[0]["tokens"],
            **{k: statistics.median(r[k] for r in per_prompt) for k in ("ttft_ms", "tbt_ms", "accept_length")},
            "per_prompt": [{k: r[k] for k in ("ttft_ms", "tbt_ms", "accept_length", "tokens")} for r in per_prompt],
        }  # fmt: skip
        if any(r["ids"] != b["ids"] for r, b in zip(per_prompt, base, strict=True)):
            row["differs_from_u_shape"] = True  # greedy HAT == U-shape up to fp near-ties (reported)
        rows.append(row)
    return rows


@dataclass(frozen=True)
class Table4Extra:
    """One of Table 4's optional rows: SD with some options changed, beside U-shape and SD."""

    key: str  # its row in the results (and the projection's)
    label: str  # its row in the printed table
    options: dict[str, Any]  # the HATOptions it changes


# Table 4's optional rows, by the flag that asks for each (--table4-ahead, --table4-no-lookup)
TABLE4_EXTRAS = {
    "table4_ahead": Table4Extra(
        "SD+ahead",
        "HAT (SD, drafting ahead: proactive and parallel)",
        {"proactive_drafting": True, "parallel_drafting": True},
    ),
    "table4_no_lookup": Table4Extra("SD-lookup", "HAT (SD, no lookup branch)", {"lookup_tokens": 0}),
}


async def table4(bench: Bench) -> dict[str, Any]:
    extras = [e for flag, e in TABLE4_EXTRAS.items() if getattr(bench.args, flag)]
    configs: list[Config] = [(v.name, v, {}) for v in (U_SHAPE, SD_ONLY)]
    configs += [(e.key, SD_ONLY, e.options) for e in extras]
    out = await table4_rows(bench, configs)
    u_shape = out[U_SHAPE.name]["tbt_ms_median"]
    out["decode_speedup"] = u_shape / out[SD_ONLY.name]["tbt_ms_median"]
    for e in extras:
        out[e.key]["speedup"] = u_shape / out[e.key]["tbt_ms_median"]
    return out


async def table4_rows(bench: Bench, configs: list[Config]) -> dict[str, Any]:
    """Every configuration on the held-out prompts, interleaved prompt by prompt (the order rotated by one each
    prompt), after one warm-up request each: a box that speeds up or slows down during the run (a shared host does)
    moves every configuration alike, so the ratios hold where sequential blocks of requests drifted apart."""
    from clients.hat.options import HATStats

    a = bench.args
    prompts = bench.held_out_prompts(a.table4_prompts)
    backends = {name: await started(bench, v, **kw) for name, v, kw in configs}
    for b in backends.values():
        await run_request(b, prompts[0], 4)
        b.stats = HATStats()  # count the measured requests only
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in configs}
    for index, ids in enumerate(prompts):
        turn = index % len(configs)
        for name, _, _ in configs[turn:] + configs[:turn]:
            runs[name].append(await run_request(backends[name], ids, a.table4_tokens))
    first = runs[configs[0][0]]  # the first configuration's requests (U-shape): the tokens to match
    out: dict[str, Any] = {}
    for name, v, _ in configs:
        b = backends[name]
        out[name] = {
            "tbt_ms_median": statistics.median(r["tbt_ms"] for r in runs[name] if r["tokens"] > 1),
            "tbt_ms_per_prompt": [round(r["tbt_ms"], 2) for r in runs[name]],
            "tokens": sum(r["tokens"] for r in runs[name]),
            "accept_length": b.stats.round_tokens / max(b.stats.rounds, 1) if v.sd else 1.0,
            # prompts whose greedy tokens differ from the first configuration's (speculation must change none)
            "prompts_differing": sum(r["ids"] != f["ids"] for r, f in zip(runs[name], first, strict=True)),
            "stats": b.stats.summary(),
        }
        shown = ("tbt_ms_median", "accept_length", "prompts_differing")
        print(f"  table4 {name}: {json.dumps({k: out[name][k] for k in shown})}", file=sys.stderr)
    for b in backends.values():
        await b.close()
    out["prompts"] = len(prompts)
    out["interleaved"] = True
    return out


async def components(bench: Bench) -> dict[str, Any]:
    b = await started(bench, SD_ONLY)
    full = await started(bench, SD_ONLY, full_vocab=True)
    ids = bench.code_prompt(512)
    hidden = b.hidden_size
    out: dict[str, Any] = {"device_ms": {}, "worker_ms": {}, "link_ms": {}}
    dev = out["device_ms"]
    half, full_half = b.half, full.half
    with torch.inference_mode():
        cache = half.input.new_cache()
        half.input(torch.tensor([ids[:256]]), cache, positions=0)

        def input_one() -> None:
            half.input(torch.tensor([[ids[256]]]), cache, positions=256)
            cache.crop(256)

        dev["input_submodel_1_token"] = median_ms(input_one, REPEATS)
        dev["input_submodel_256_tokens"] = median_ms(
            lambda: half.input(torch.tensor([ids[:256]]), None, positions=0), 3
        )
        feats = torch.randn(1, hidden)
        dev["draft_head_reduced_vocab"] = median_ms(lambda: half.draft_logits(feats, 0), REPEATS)
        dev["draft_head_full_vocab"] = median_ms(lambda: full_half.draft_logits(feats, 0), REPEATS)
        if half.draft_weight is not None:  # the same rows in fp32 (draft_precision = "fp32"), beside the default
            normed = half.output.norm(feats)
            weight = half.draft_weight
            dev["draft_head_reduced_vocab_fp32"] = median_ms(lambda: rows_linear(normed, weight), REPEATS)
        acache = half.adapter.new_cache()
        shallow = half.input(torch.tensor([ids[:256]]), None, positions=0)
        half.adapter(shallow, acache, positions=0)

        def adapter_one() -> None:
            half.adapter(shallow[:, :1], acache, positions=256)
            acache.crop(256)

        dev["adapter_1_token"] = median_ms(adapter_one, REPEATS)
        body = dev["input_submodel_1_token"] + dev["adapter_1_token"]
        dev["draft_step_reduced_vocab"] = body + dev["draft_head_reduced_vocab"]
        dev["draft_step_full_vocab"] = body + dev["draft_head_full_vocab"]
        for rows in (1, 4):
            deep = torch.randn(rows, hidden)
            dev[f"lm_head_{rows}_rows"] = median_ms(lambda deep=deep: half.output(deep), REPEATS)
            # greedy verification's head (head_precision "int8": int8 scores, the rows that can win in fp32)
            dev[f"lm_head_argmax_{rows}_rows"] = median_ms(lambda deep=deep: half.argmax_rows(deep), REPEATS)
    await b.close()
    await full.close()
    token_bytes = hidden * 4
    out["worker_ms"] = await worker_compute(bench, bench.args.worker_counts)
    link = bench.link
    for n in (1, 4, 256):
        up = n * token_bytes / link.up_bandwidth if link.up_bandwidth else 0.0
        down = n * token_bytes / link.down_bandwidth if link.down_bandwidth else 0.0
        out["link_ms"][f"{n}_tokens"] = {"upload": 1e3 * (up + link.latency), "download": 1e3 * (down + link.latency)}
    out["token_bytes"] = token_bytes
    return out


def shallow_states(bench: Bench, n: int) -> torch.Tensor:
    from clients.hat.split import InputSubmodel

    ids = bench.code_prompt(max(n, 128))[:n]
    with torch.inference_mode():
        return InputSubmodel(bench.model, bench.args.m)(torch.tensor([ids]), None)[0]


async def worker_compute(bench: Bench, counts: list[int]) -> dict[str, float]:
    """Median loopback round trip of an n-token frame (no link emulation) minus that of an empty round trip."""
    from clients.hat import wire

    states = shallow_states(bench, max(counts) + 16)
    out: dict[str, float] = {}
    async with RawDevice(bench.url, bench) as d:
        await d.send(states[:16], 0, wire.Kind.PREFILL_CHUNK)
        for n in counts:
            samples = []
            for _ in range(5 if n <= 64 else 2):
                t0 = time.perf_counter()
                await d.send(states[16 : 16 + n], 16, wire.Kind.DRAFT)
                samples.append(time.perf_counter() - t0)
                await d.rollback(16)
            out[f"middle_{n}_tokens"] = 1e3 * statistics.median(samples)
    return out


async def sweep(bench: Bench) -> dict[str, Any]:
    from clients.hat.link import LinkProfile

    a, base = bench.args, bench.link
    out: dict[str, Any] = {"rtt": [], "up_bandwidth": []}
    short = bench.code_prompt(128)
    for rtt in a.sweep_rtt_ms:
        link = LinkProfile(latency=rtt / 2e3, up_bandwidth=base.up_bandwidth, down_bandwidth=base.down_bandwidth)
        row: dict[str, Any] = {"rtt_ms": rtt}
        for v in (U_SHAPE, SD_ONLY, SD_PD):
            b = await started(bench, v, link=link)
            row[v.name] = (await run_request(b, short, a.sweep_tokens))["tbt_ms"]
            await b.close()
        out["rtt"].append(row)
        print(f"  sweep rtt {rtt:5.0f} ms: " + "  ".join(f"{k} {v:.1f}" for k, v in row.items() if k != "rtt_ms"),
              file=sys.stderr)  # fmt: skip
    long = bench.code_prompt(a.sweep_prompt)
    for mbps in a.sweep_up_mbps:
        link = LinkProfile(latency=base.latency, up_bandwidth=mbps * 1e6, down_bandwidth=base.down_bandwidth)
        row = {"up_MBps": mbps}
        for v in (U_SHAPE, Variant(False, True, False)):
            b = await started(bench, v, link=link)
            row[v.name] = (await run_request(b, long, 1))["ttft_ms"]
            await b.close()
        out["up_bandwidth"].append(row)
        print(f"  sweep up {mbps:5.1f} MB/s: " + "  ".join(f"{k} {v:.0f}" for k, v in row.items() if k != "up_MBps"),
              file=sys.stderr)  # fmt: skip
    return out


async def throughput(bench: Bench) -> dict[str, Any]:
    """Decode tokens/s of the worker for N devices: concurrent (continuous batching) vs one at a time."""
    from clients.hat import wire

    a = bench.args
    prompt = 64
    states = shallow_states(bench, prompt + a.throughput_tokens)

    async def one_device() -> int:
        async with RawDevice(bench.url, bench) as d:
            await d.send(states[:prompt], 0, wire.Kind.PREFILL_CHUNK)
            for i in range(a.throughput_tokens):
                await d.send(states[prompt + i : prompt + i + 1], prompt + i, wire.Kind.DRAFT)
        return a.throughput_tokens

    out = []
    await one_device()  # warm-up
    for n in a.throughput_devices:
        t0 = time.perf_counter()
        done = sum(await asyncio.gather(*(one_device() for _ in range(n))))
        concurrent = done / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        done = 0
        for _ in range(n):
            done += await one_device()
        sequential = done / (time.perf_counter() - t0)
        out.append({"devices": n, "batched_tok_s": concurrent, "one_at_a_time_tok_s": sequential,
                    "ratio": concurrent / sequential})  # fmt: skip
        print(f"  throughput {n} devices: batched {concurrent:.1f} tok/s, one at a time {sequential:.1f} tok/s",
              file=sys.stderr)  # fmt: skip
    return {"prompt_tokens": prompt, "decode_tokens_per_device": a.throughput_tokens, "rows": out}


DRAFT_LENGTH_MODES = ("eta", "eq7", "eq7+eta")


async def draft_length(bench: Bench) -> dict[str, Any]:
    """TBT of SD (chunked prefill, no parallel drafting) under each draft-length rule, per RTT: one warm-up request
    per backend (so the Eq. 7 controller has measured acceptance and timings), then one measured request."""
    from clients.hat.link import LinkProfile

    a, base = bench.args, bench.link
    warm, ids = bench.code_prompt(96), bench.code_prompt(128)
    rows = []
    for rtt in a.draft_length_rtt_ms:
        link = LinkProfile(latency=rtt / 2e3, up_bandwidth=base.up_bandwidth, down_bandwidth=base.down_bandwidth)
        row: dict[str, Any] = {"rtt_ms": rtt}
        for mode in DRAFT_LENGTH_MODES:
            b = await started(bench, Variant(True, True, False), link=link, draft_length=mode)
            await run_request(b, warm, a.draft_length_tokens)
            before = (b.stats.rounds, b.stats.drafted, b.stats.draft_cap_sum)
            r = await run_request(b, ids, a.draft_length_tokens)
            rounds = max(b.stats.rounds - before[0], 1)
            row[mode] = {
                "tbt_ms": r["tbt_ms"],
                "accept_length": r["accept_length"],
                "drafted_per_round": (b.stats.drafted - before[1]) / rounds,
                "mean_cap": (b.stats.draft_cap_sum - before[2]) / rounds,
                "alpha_hat": b.controller.alpha,
                "status_updates": b.stats.status_updates,
                "ids": r["ids"],
            }
            await b.close()
            print(f"  draft_length rtt {rtt:4.0f} ms {mode:8s} TBT {r['tbt_ms']:6.1f} ms  accept "
                  f"{r['accept_length']:.2f}  drafted/round {row[mode]['drafted_per_round']:.2f}  "
                  f"alpha_hat {b.controller.alpha:.2f}", file=sys.stderr)  # fmt: skip
        ids_by_mode = {mode: row[mode].pop("ids") for mode in DRAFT_LENGTH_MODES}
        for mode in DRAFT_LENGTH_MODES:  # greedy: the same tokens under every rule (up to fp near-ties)
            row[mode]["same_as_eta"] = ids_by_mode[mode] == ids_by_mode["eta"]
        rows.append(row)
    return {"prompt_tokens": len(ids), "decode_tokens": a.draft_length_tokens, "rows": rows}


async def trees(bench: Bench) -> dict[str, Any]:
    """Chains vs token trees (SD alone): accept length and median TBT on the held-out chat prompts (Table 4's) and
    on code-reading prompts, against U-shape in the same run. Trees are shaped from policies/trees.py's prior."""
    from clients.hat.options import HATStats

    a = bench.args
    sets = {
        "chat": bench.held_out_prompts(a.table4_prompts),
        "code": [bench.code_prompt(n) for n in a.tree_code_lengths],
    }
    shapes = [("U-shape", U_SHAPE, 0), ("chain", SD_ONLY, 0), *((f"tree w={w}", SD_ONLY, w) for w in a.tree_widths)]
    rows: list[dict[str, Any]] = []
    for name, v, width in shapes:
        b = await started(bench, v, tree_width=width)
        await run_request(b, sets["chat"][0], 4)
        row: dict[str, Any] = {"shape": name, "width": width}
        for kind, prompts in sets.items():
            b.stats = HATStats()
            runs = [await run_request(b, ids, a.table4_tokens) for ids in prompts]
            row[kind] = {
                "tbt_ms_median": statistics.median(r["tbt_ms"] for r in runs if r["tokens"] > 1),
                "accept_length": b.stats.round_tokens / max(b.stats.rounds, 1) if v.sd else 1.0,
                "stats": b.stats.summary(),
                "ids": [r["ids"] for r in runs],
            }
        await b.close()
        rows.append(row)
        print(f"  trees {name:10s} chat TBT {row['chat']['tbt_ms_median']:6.1f} accept "
              f"{row['chat']['accept_length']:.2f} | code TBT {row['code']['tbt_ms_median']:6.1f} accept "
              f"{row['code']['accept_length']:.2f}", file=sys.stderr)  # fmt: skip
    base = rows[0]
    base_ids = {kind: base[kind]["ids"] for kind in sets}
    for row in rows:
        for kind in sets:
            row[kind]["speedup"] = base[kind]["tbt_ms_median"] / row[kind]["tbt_ms_median"]
            row[kind]["same_as_u_shape"] = row[kind].pop("ids") == base_ids[kind]
    return {"chat_prompts": len(sets["chat"]), "code_lengths": a.tree_code_lengths, "rows": rows}


async def chunks(bench: Bench) -> dict[str, Any]:
    """TTFT of the Table 5 prompts prefilled as one frame, as Eq. 3's equal chunks and as Jupiter's DP chunks over
    the device -> link -> worker pipeline (one request each, interleaved per length, after a warm-up)."""
    a = bench.args
    pc = Variant(False, True, False)
    backends = {
        "one frame": await started(bench, U_SHAPE),
        "Eq. 3": await started(bench, pc),
        "DP": await started(bench, pc, chunking="dp"),
    }
    for b in backends.values():
        await run_request(b, bench.code_prompt(128), 1)
    rows = []
    for length in a.lengths:
        ids = bench.code_prompt(length)
        row: dict[str, Any] = {"prompt_tokens": length}
        for name, b in backends.items():
            row[name] = (await run_request(b, ids, 1))["ttft_ms"]
            row[f"{name} chunks"] = list(b.stats.last_chunks)
        rows.append(row)
        print(f"  chunks {length:5d}: " + "  ".join(f"{n} {row[n]:.0f} ms" for n in backends), file=sys.stderr)
    for b in backends.values():
        await b.close()
    return {"rows": rows}
