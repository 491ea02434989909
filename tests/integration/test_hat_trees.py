"""Token trees end to end on real weights (SmolLM2): greedy output, the worker's tree frames, privacy, KEEP.

A draft head that knows the U-shape answer (OracleHAT: right and confident at most positions, the right token
second at every third) makes the tree's extra branches matter: a chain stops at the unsure positions, a tree
with a rank-1 child accepts through them.
"""

from __future__ import annotations

import json

import pytest
import torch

from clients.hat import wire
from clients.hat.options import HATOptions
from clients.hat.tree import draft_lookup, draft_tree, keep_path
from policies.trees import from_paths
from tests.integration.hf_fixtures import SMOL, chat_prompt, check_against_reference, load
from tests.integration.test_hat import (
    PROMPT,
    TOKEN,
    N,
    OracleHAT,
    WorkerServer,
    collect,
    greedy_drafter,
    open_raw,
    prompt_ids,
    recv_reply,
    shallow_of,
    token_ids,
    u_shape_greedy,
    wait_for,
)

Kind = wire.Kind


@pytest.fixture(scope="module")
def smol():
    return load(SMOL)


@pytest.fixture(scope="module")
def worker(smol):
    server = WorkerServer(smol[0], SMOL, max_sessions=6, idle_timeout=60).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference(smol):
    return u_shape_greedy(smol[0], prompt_ids(smol[1]), N)


def oracle(worker: WorkerServer, model, tok, answer: dict[int, int], url: str, **kw) -> OracleHAT:
    options = HATOptions(worker_url=url, auth_token=TOKEN, chunk_size=16, **kw)
    return OracleHAT(options, model_id=SMOL, model=model, tokenizer=tok, answer=answer)


async def test_greedy_trees_equal_u_shape_over_both_transports_and_beat_the_chain(worker, smol, reference) -> None:
    model, tok = smol
    ref, gaps = reference
    ids = prompt_ids(tok)
    answer = {len(ids) + i: t for i, t in enumerate(ref)}
    chain = oracle(worker, model, tok, answer, worker.ws)
    await chain.start()
    chain_out = token_ids(await collect(chain, ids))
    chain_len = chain.stats.summary()["accept_length"]
    await chain.close()
    check_against_reference(chain_out, ref, gaps)
    # The prior's shape (w = 4: top-3 and one grandchild) and a spine of top-1s with top-2 branches (w = 8).
    spine = ((0,), (1,), (0, 0), (1, 0), (0, 0, 0), (1, 0, 0), (0, 0, 0, 0))
    for width, paths in ((4, None), (8, spine)):
        for url in (worker.ws, worker.http):
            backend = oracle(worker, model, tok, answer, url, tree_width=width, tree_paths=paths)
            await backend.start()
            got = token_ids(await collect(backend, ids))
            stats = backend.stats.summary()
            print(f"tree w={width} {backend.transport}: {stats} (chain: {chain_len:.2f})")
            await backend.close()
            # The U-shape answer whatever was verified (a tree's pass is another computation path than a chain's:
            # each is held to the reference under the near-tie rule, not to the other).
            check_against_reference(got, ref, gaps)
            # every round a tree but where the answer's end left less room than the tree's depth
            assert backend.stats.tree_rounds >= max(1, backend.stats.rounds - backend.tree.depth)
            if paths is not None:
                assert stats["accept_length"] > chain_len  # the top-2 branches accept where the chain stops
    await wait_for(lambda: worker.engine.session_count == 0)


async def test_tree_frames_carry_structure_only(worker, smol) -> None:
    """The privacy invariant with trees: TREE and KEEP carry node indices, never token ids or text."""
    model, tok = smol
    backend = worker.backend(model, tok, SMOL, tree_width=8)
    await backend.start()
    worker.frames.clear()
    ids = prompt_ids(tok)
    events = await collect(backend, ids, max_tokens=10)
    await backend.close()
    await wait_for(lambda: worker.engine.session_count == 0)
    assert backend.stats.tree_rounds >= 1
    text = chat_prompt(tok, PROMPT).encode()
    answer = "".join(e.text for e in events).encode()
    answer_ids = [e.token_id for e in events if e.token_id is not None]
    kinds: dict[Kind, int] = {}
    for _sid, data in worker.frames:
        frame = wire.decode_frame(data)
        kinds[frame.kind] = kinds.get(frame.kind, 0) + 1
        if frame.kind == Kind.TREE:
            parents = frame.indices()
            assert parents[0] == -1 and all(0 <= p < i for i, p in enumerate(parents[1:], start=1))
            assert len(parents) == 8
        elif frame.kind == Kind.KEEP:
            nodes = frame.indices()
            assert nodes[0] == 0 and all(0 <= n < 8 for n in nodes)
        elif frame.kind in (Kind.PREFILL_CHUNK, Kind.DRAFT):
            assert frame.dtype == wire.DType.FLOAT32 and frame.shape[-1] == model.config.hidden_size
        elif frame.kind == Kind.OPEN:
            assert set(json.loads(frame.text())) <= {"protocol", "hidden_size", "num_layers", "m", "dtype", "model"}
        else:
            assert frame.kind in (Kind.ROLLBACK, Kind.CLOSE) and frame.payload == b""
        if frame.kind in (Kind.TREE, Kind.KEEP):  # index payloads: no token id of the prompt or answer in them
            values = set(frame.indices())
            assert values <= set(range(-1, 8)), values
            assert not values & ({t for t in (*ids, *answer_ids) if t >= 8})
        for secret in (text[:24], text[-24:], answer[:12]):
            assert secret not in data
    assert kinds.get(Kind.TREE, 0) == kinds.get(Kind.KEEP, 0) == backend.stats.tree_rounds


async def test_worker_keeps_exactly_the_accepted_path(worker, smol) -> None:
    """A tree's kept path leaves the worker's cache as if that path alone had been sent as a chain; malformed tree
    frames are refused with errors naming the problem, and the session goes on."""
    model, tok = smol
    ids = prompt_ids(tok)
    hidden = model.config.hidden_size
    x = shallow_of(model, [*ids, 42, 43, 44])
    prompt, chain_rows = x[: len(ids)], x[len(ids) :]
    # The tree: root (42) with children a (43, kept) and b (noise); a's child (44, kept); b's child (noise).
    parents = [-1, 0, 0, 1, 2]
    noise = torch.randn(2, hidden, generator=torch.Generator().manual_seed(1))
    tree_rows = torch.stack([chain_rows[0], chain_rows[1], noise[0], chain_rows[2], noise[1]])
    after = shallow_of(model, [*ids, 42, 43, 44, 45])[-1:]
    results = []
    for use_tree in (False, True):
        ws, sid, _ = await open_raw(worker)
        seq = 1
        await ws.send(wire.encode_tensor(Kind.PREFILL_CHUNK, sid, seq, prompt))
        assert (await recv_reply(ws)).kind == Kind.DEEP_STATE
        if use_tree:
            seq += 1
            await ws.send(wire.encode_indices(Kind.TREE, sid, seq, parents, arg=len(ids)))
            seq += 1
            await ws.send(wire.encode_tensor(Kind.DRAFT, sid, seq, tree_rows, arg=len(ids)))
            deep = (await recv_reply(ws)).tensor()
            seq += 1  # a DRAFT while the tree is open is refused; the session lives on
            await ws.send(wire.encode_tensor(Kind.DRAFT, sid, seq, after, arg=len(ids) + 3))
            err = await recv_reply(ws)
            assert err.kind == Kind.ERROR and "KEEP" in err.text()
            seq += 1  # a KEEP that is not a root path
            await ws.send(wire.encode_indices(Kind.KEEP, sid, seq, [0, 2, 3], arg=len(ids)))
            err = await recv_reply(ws)
            assert err.kind == Kind.ERROR and "not a path from the root" in err.text()
            seq += 1
            await ws.send(wire.encode_indices(Kind.KEEP, sid, seq, [0, 1, 3], arg=len(ids)))
            kept = deep[[0, 1, 3]]
        else:
            seq += 1
            await ws.send(wire.encode_tensor(Kind.DRAFT, sid, seq, chain_rows, arg=len(ids)))
            kept = (await recv_reply(ws)).tensor()
        seq += 1
        await ws.send(wire.encode_tensor(Kind.DRAFT, sid, seq, after, arg=len(ids) + 3))
        reply = await recv_reply(ws)
        assert reply.kind == Kind.VERIFY_RESULT, reply.text() if reply.kind == Kind.ERROR else reply.kind
        results.append((kept, reply.tensor()))
        await ws.close()
    (chain_kept, chain_next), (tree_kept, tree_next) = results
    # The tree's path rows see exactly what the chain's rows saw (ancestors only), so the same deep states up to
    # float reassociation (different row counts in the pass); the next round after KEEP likewise.
    torch.testing.assert_close(tree_kept, chain_kept, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(tree_next, chain_next, rtol=1e-4, atol=1e-4)


async def test_tree_frames_that_do_not_fit_are_refused(worker, smol) -> None:
    model, tok = smol
    ids = prompt_ids(tok)
    x = shallow_of(model, [*ids, 42])
    ws, sid, _ = await open_raw(worker)
    await ws.send(wire.encode_tensor(Kind.PREFILL_CHUNK, sid, 1, x[: len(ids)]))
    assert (await recv_reply(ws)).kind == Kind.DEEP_STATE
    bad_tree = wire.encode_indices(Kind.TREE, sid, 2, [-1, 0, 0], arg=len(ids))
    bad_tree = bad_tree[:-4] + (5).to_bytes(4, "little", signed=True)  # parents[2] = 5: not an earlier node
    await ws.send(bad_tree)
    err = await recv_reply(ws)
    assert err.kind == Kind.ERROR and err.arg == 400 and "parent must be an earlier node" in err.text()
    await ws.send(wire.encode_indices(Kind.TREE, sid, 3, [-1, 0, 0], arg=len(ids)))
    await ws.send(wire.encode_tensor(Kind.DRAFT, sid, 4, x[len(ids) :], arg=len(ids)))  # 1 row for a 3-node tree
    err = await recv_reply(ws)
    assert err.kind == Kind.ERROR and "exactly those rows" in err.text()
    await ws.send(wire.encode_indices(Kind.KEEP, sid, 5, [0], arg=len(ids)))  # no tree is open
    err = await recv_reply(ws)
    assert err.kind == Kind.ERROR and "no token tree is open" in err.text()
    await ws.send(wire.encode_tensor(Kind.DRAFT, sid, 6, x[len(ids) :], arg=len(ids)))
    assert (await recv_reply(ws)).kind == Kind.VERIFY_RESULT  # the session still works
    await ws.close()


def test_device_tree_drafting_keeps_its_caches_consistent(smol) -> None:
    """Drafting a tree and keeping one path leaves the draft caches as if that path had been fed as a chain."""
    model, tok = smol
    from clients.hat.drafting import Drafter
    from clients.hat.half import DeviceHalf
    from policies.drafting import DraftStopRule

    drafter = Drafter(DeviceHalf.load(model, 2), DraftStopRule(), 3)  # the untrained adapter
    ids = prompt_ids(tok)
    tree = from_paths([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)])
    st = drafter.new_state()
    drafter.prefill(st, ids[:-1], 0)
    draft = draft_tree(drafter, st, ids[-1], len(ids) - 1, tree)
    assert draft.shallow.shape == (tree.width, model.config.hidden_size)
    assert len(st.input_cache) == len(ids) - 1 + tree.width
    assert draft.tokens[1] != draft.tokens[2]  # top-1 and top-2 under the root
    path = [0, 2, 4]  # root -> rank 1 -> its rank-0 child
    keep_path(st, len(ids) - 1, path)
    assert st.input_cache.positions.tolist() == list(range(len(ids) + 2))
    chain = drafter.new_state()
    drafter.prefill(chain, [*ids, draft.tokens[2], draft.tokens[4]], 0)
    for got, want in ((st.input_cache, chain.input_cache), (st.adapter_cache, chain.adapter_cache)):
        for layer in got._keys:
            for a, b in zip(got.layer(layer), want.layer(layer), strict=True):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


REPEAT = "Write a Python class Point with methods add, sub and scale, each returning a new Point."


async def test_lookup_branches_accept_copied_text_and_keep_the_u_shape_answer(worker, smol) -> None:
    """With the untrained adapter the chain rarely accepts; code that repeats its prompt and itself (self.x, other.x)
    comes in through the lookup branch instead (tokens accepted on a branch node: the chain's drafts there were
    rejected or had ended) — the output still the U-shape answer (the near-tie rule), the worker told only the tree's
    structure. (Without lookup no tree is sent: the bench's --table4-no-lookup row, test_bench_hat.)"""
    model, tok = smol
    ids = prompt_ids(tok, REPEAT)
    n = 40
    ref, gaps = u_shape_greedy(model, ids, n)
    backend = worker.backend(model, tok, SMOL)  # lookup_tokens: the default
    await backend.start()
    worker.frames.clear()
    got = token_ids(await collect(backend, ids, max_tokens=n))
    await backend.close()
    check_against_reference(got, ref, gaps)
    kinds = [wire.decode_frame(data).kind for _sid, data in worker.frames]
    stats = backend.stats.summary()
    print(f"lookup: {stats}")
    assert kinds.count(Kind.TREE) == kinds.count(Kind.KEEP) == stats["lookup_rounds"] == stats["tree_rounds"] >= 1
    assert stats["lookup_accepted"] >= 1
    await wait_for(lambda: worker.engine.session_count == 0)


def test_a_lookup_branch_kept_leaves_the_caches_as_if_its_path_were_fed_as_a_chain(smol) -> None:
    """A chain drafted, a lookup branch leaving it after its first draft fed beside it in one call, and the path
    through the branch kept: the draft caches are a teacher-forced feed of that path."""
    model, tok = smol
    ids = prompt_ids(tok)
    position = len(ids) - 1
    drafter, st, sampling = greedy_drafter(model, ids, max_draft=3)
    chain = drafter.draft(st, ids[-1], position, 3, sampling)
    assert len(chain.tokens) == 3
    branch = [t for t in (11, 12, 13) if t != chain.tokens[1]][:2]
    tree_draft = draft_lookup(drafter, st, ids[-1], chain, branch, 1, position)
    assert tree_draft.tree.parents == (-1, 0, 1, 2, 1, 4)
    assert tree_draft.tokens == [ids[-1], *chain.tokens, *branch]
    assert tree_draft.shallow.shape == (6, model.config.hidden_size) and len(st.input_cache) == position + 6
    keep_path(st, position, [0, 1, 4, 5])  # root -> the chain's first draft -> the branch
    assert st.input_cache.positions.tolist() == list(range(len(ids) + 3))
    fed = drafter.new_state()
    drafter.prefill(fed, [*ids, chain.tokens[0], *branch], 0)
    for got, want in ((st.input_cache, fed.input_cache), (st.adapter_cache, fed.adapter_cache)):
        for layer in got._keys:
            for a, b in zip(got.layer(layer), want.layer(layer), strict=True):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    teacher = drafter.new_state()
    rows = drafter.prefill(teacher, [*ids, chain.tokens[0], *branch], 0)[-3:]
    torch.testing.assert_close(tree_draft.shallow[[1, 4, 5]], rows, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bad", [[-1, 1], [0], [-1, 0, 0, 7]])
def test_tree_codec_rejects_malformed_structure(bad) -> None:
    from app.worker.sessions import Session, check_frame
    from clients.hat.split import SplitKVCache

    sid = b"s" * 16
    session = Session(sid, SplitKVCache(range(2, 3)), None, 0.0, 0.0)  # type: ignore[arg-type]
    _, _, err = check_frame(session, wire.encode_indices(Kind.TREE, sid, 1, bad, arg=3), 1 << 20, 8, torch.float32)
    assert err is not None and err.status == 400 and "TREE" in err.message


def test_index_frames_round_trip_and_refuse_bad_headers() -> None:
    sid = b"s" * 16
    data = wire.encode_indices(Kind.KEEP, sid, 4, [0, 2, 5], arg=17)
    frame = wire.decode_frame(data)
    assert (frame.kind, frame.arg, frame.indices()) == (Kind.KEEP, 17, [0, 2, 5])
    with pytest.raises(wire.FrameError, match=r"1\.\.1024"):
        wire.encode_indices(Kind.TREE, sid, 1, [], arg=0)
    with pytest.raises(wire.FrameError, match="do not carry tree indices"):
        wire.encode_indices(Kind.DRAFT, sid, 1, [0], arg=0)
    tampered = bytearray(data)
    tampered[6] = int(wire.DType.FLOAT32)  # an index frame must carry INT32
    with pytest.raises(wire.FrameError, match="INT32"):
        wire.decode_frame(bytes(tampered))
