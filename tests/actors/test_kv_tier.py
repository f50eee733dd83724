"""The KV tier's store (actors/kv_tier.py): every block read back is the one written, bit for bit, through
≥ 10,000 randomized write/read/evict cycles over a node tier and a disk tier; a corrupted, truncated or
foreign entry is a counted miss, never an answer; the size bound and LRU order hold, across processes too."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import random
from collections import OrderedDict

import pytest
import torch

from actors.kv_tier import Tier, Tiers
from cluster.kv_transfer import Fingerprint, layout_digest

FP = Fingerprint(model="m" * 32, dtype="bfloat16", block_size=16, latent=(3, 64), conv=(2, 3, 3, 32),
                 recurrent=(2, 2, 16, 16))
LAYOUT = layout_digest(FP)


def block(rng: torch.Generator, fp: Fingerprint = FP, snapshot: bool = False) -> dict[str, torch.Tensor]:
    """One block's parts in ``fp``'s layout, random bits (NaN patterns and all: they must survive exactly)."""
    dtype = getattr(torch, fp.dtype)
    raw = torch.randint(-2**15, 2**15, (fp.latent[0], fp.block_size, fp.latent[1]), generator=rng, dtype=torch.int16)
    parts = {"latent": raw.view(dtype) if dtype.itemsize == 2 else raw.to(dtype)}
    if snapshot:
        parts["conv"] = torch.randn(fp.conv, generator=rng).to(dtype)
        parts["recurrent"] = torch.randn(fp.recurrent, generator=rng)
    return parts


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
                                        and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def entry_size(tmp_path) -> int:
    t = Tier(tmp_path / "probe", 1 << 30, LAYOUT)
    return t.put(b"k" * 16, block(torch.Generator().manual_seed(0)))


def test_ten_thousand_random_cycles_read_back_bit_identical_and_lru_keeps_the_recent(tmp_path):
    size = entry_size(tmp_path)
    node_n, disk_n = 24, 64  # entries each tier holds
    tiers = Tiers(Tier(tmp_path / "node", node_n * size, LAYOUT, rescan_every=16),
                  Tier(tmp_path / "disk", disk_n * size, LAYOUT, name="disk", rescan_every=16))
    rng, gen = random.Random(56), torch.Generator().manual_seed(56)
    written: dict[bytes, dict] = {}
    sizes: dict[bytes, int] = {}
    recent: OrderedDict[bytes, None] = OrderedDict()  # stored keys by last use (the node tier's LRU order)
    keys = [os.urandom(16) for _ in range(120)]  # the working set: more than both tiers hold
    served = missed = 0

    def newest_that_fit() -> set[bytes]:
        """The most recently used keys whose entries fit the node tier's low-water mark together (what making room
        evicts down to): LRU keeps every one."""
        out, total = set(), 0
        for k in reversed(recent):
            total += sizes[k]
            if total > tiers.node.low_water:
                break
            out.add(k)
        return out

    for cycle in range(10_000):
        key = rng.choice(keys)
        if rng.random() < 0.4:
            written[key] = block(gen, snapshot=rng.random() < 0.2)
            sizes[key] = len(tiers.node.encode(key, written[key]))
            tiers.put(key, written[key])
        else:
            keep = newest_that_fit()
            got = tiers.get(key)
            if got is None:
                missed += 1
                assert key not in keep, (cycle, "LRU lost one of the most recently used entries")
                continue
            served += 1
            assert key in written and same(got, written[key]), (cycle, "read back different bits")
        recent.pop(key, None)
        recent[key] = None
        assert tiers.node.used_bytes() <= tiers.node.capacity and tiers.disk.used_bytes() <= tiers.disk.capacity
    node, disk = tiers.status()
    assert served > 2000 and missed > 500, (served, missed)
    assert disk["hits"] > 100 and node["evictions"] > 100 and disk["evictions"] > 0, (node, disk)
    assert set(node["misses"]) <= {"absent"} and set(disk["misses"]) <= {"absent"}, (node, disk)


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "empty", "another key's entry"])
def test_a_damaged_entry_is_a_counted_miss_and_goes(tmp_path, damage):
    tier = Tier(tmp_path, 1 << 20, LAYOUT)
    gen = torch.Generator().manual_seed(1)
    a, b = block(gen), block(gen)
    tier.put(b"a" * 16, a)
    tier.put(b"b" * 16, b)
    f = tier._file(b"a" * 16)
    data = bytearray(f.read_bytes())
    if damage == "flip a byte":
        data[-100] ^= 0x01  # in the tensor bytes: the header still parses, the checksum does not match
    elif damage == "truncate":
        data = data[:len(data) // 2]
    elif damage == "empty":
        data = bytearray()
    else:
        data = bytearray(tier._file(b"b" * 16).read_bytes())  # a whole entry, of another key
    f.write_bytes(bytes(data))
    assert tier.get(b"a" * 16) is None
    want = {"flip a byte": "corrupt", "truncate": "torn", "empty": "torn", "another key's entry": "layout"}[damage]
    assert tier.status()["misses"] == {want: 1} and not f.exists()
    assert tier.get(b"a" * 16) is None and tier.status()["misses"] == {want: 1, "absent": 1}
    assert same(tier.get(b"b" * 16), b)  # the other entry untouched


@pytest.mark.parametrize("field, value", [("dtype", "float16"), ("block_size", 32), ("model", "n" * 32),
                                          ("latent", (3, 32))])
def test_the_same_key_under_another_layout_never_hits(tmp_path, field, value):
    """Keys alone are not enough (SGLang #33268: a dtype missing from the key): the layout names the entry."""
    ours = Tier(tmp_path, 1 << 20, LAYOUT)
    ours.put(b"k" * 16, block(torch.Generator().manual_seed(2)))
    other_fp = dataclasses.replace(FP, **{field: value})
    assert layout_digest(other_fp) != ours.layout
    other = Tier(tmp_path, 1 << 20, layout_digest(other_fp))
    assert other.get(b"k" * 16) is None and other.status()["misses"] == {"absent": 1}
    # and an entry of another layout planted under this layout's name is refused by its metadata
    ours._file(b"j" * 16).write_bytes(other.encode(b"j" * 16, block(torch.Generator().manual_seed(3), FP)))
    assert ours.get(b"j" * 16) is None and ours.status()["misses"] == {"layout": 1}


def test_the_size_bound_holds_and_an_entry_too_large_is_refused(tmp_path):
    size = entry_size(tmp_path)
    tier = Tier(tmp_path / "t", 3 * size, LAYOUT)
    gen = torch.Generator().manual_seed(4)
    for i in range(5):
        tier.put(bytes([i]) * 16, block(gen))
    assert tier.used_bytes() <= 3 * size and tier.status()["evictions"] == 2
    assert [tier.get(bytes([i]) * 16) is not None for i in range(5)] == [False, False, True, True, True]
    # over its bound, a tier is evicted down to its low-water mark (90 %): here 2 entries, then 3 fit again
    big = Tier(tmp_path / "big", 20 * size, LAYOUT)
    for i in range(21):
        big.put(bytes([i]) * 16, block(gen))
    assert big.used_bytes() <= big.low_water and big.status()["evictions"] == 3
    for i in range(21, 23):  # no scan needed until it is over again
        big.put(bytes([i]) * 16, block(gen))
    assert big.status()["evictions"] == 3 and big.used_bytes() <= 20 * size
    with pytest.raises(ValueError, match="does not fit the node tier"):
        Tier(tmp_path / "small", size // 2, LAYOUT).put(b"x" * 16, block(gen))
    with pytest.raises(ValueError, match="size must be > 0"):
        Tier(tmp_path / "none", 0, LAYOUT)


def test_an_entry_sent_to_another_node_is_checked_on_arrival_and_names_list_the_recent(tmp_path):
    """What a load from another node's tier moves: an entry's bytes as stored there (``Tiers.fetch``, a disk hit
    promoted on the way), checked on arrival as a read is (``Tier.check``: a flipped byte or another key's entry
    is a counted miss, and nothing is removed on either side), filed whole (``put_entry``). ``names`` lists the
    most recently used first (the engine's index after a restart); a tier whose directory was removed under it
    makes it again on its next write."""
    from actors.kv_tier import block_key, entry_name

    size = entry_size(tmp_path)
    there = Tiers(Tier(tmp_path / "a", 2 * size, LAYOUT), Tier(tmp_path / "a-disk", 8 * size, LAYOUT, name="disk"))
    here = Tiers(Tier(tmp_path / "b", 8 * size, LAYOUT))
    gen = torch.Generator().manual_seed(6)
    parts = {i: block(gen) for i in range(3)}
    for i in range(3):
        there.put(block_key(bytes([i]) * 16), parts[i])  # the first one moves down to disk
    key = block_key(bytes([0]) * 16)
    parts0, data = there.fetch(key)
    assert same(parts0, parts[0]) and there.disk.status()["hits"] == 1
    assert same(here.node.check(key, data), parts[0])
    flipped = bytearray(data)
    flipped[-5] ^= 1
    assert here.node.check(key, bytes(flipped)) is None and here.node.check(block_key(b"x" * 16), data) is None
    assert dict(here.node.status()["misses"]) == {"corrupt": 1, "layout": 1}
    here.put_entry(key, data)
    assert same(here.get(key), parts[0])
    assert there.names(2) == [entry_name(LAYOUT, key), entry_name(LAYOUT, block_key(bytes([2]) * 16))]
    for f in (tmp_path / "b").iterdir():
        f.unlink()
    (tmp_path / "b").rmdir()
    here.put(block_key(b"y" * 16), parts[1])
    assert same(here.get(block_key(b"y" * 16)), parts[1])


def _hammer(path: str, capacity: int, seed: int, rounds: int, q) -> None:
    tier = Tier(path, capacity, LAYOUT, rescan_every=8)
    rng = random.Random(seed)
    wrong = 0
    for _ in range(rounds):
        k = rng.randrange(40)
        key = k.to_bytes(16, "little")
        # each key always holds the same content (a function of the key), whoever writes it
        want = block(torch.Generator().manual_seed(k))
        if rng.random() < 0.5:
            tier.put(key, want)
        else:
            got = tier.get(key)
            wrong += got is not None and not same(got, want)
    q.put((wrong, tier.status()))


def test_processes_sharing_a_tier_never_read_a_torn_or_wrong_entry(tmp_path):
    """Two processes write, read and evict in one directory at once (every actor of a node does): each read is
    a whole, right entry or a miss, and the bound holds when both are done."""
    size = entry_size(tmp_path)
    path = str(tmp_path / "shared")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_hammer, args=(path, 12 * size, s, 400, q)) for s in (1, 2)]
    for p in procs:
        p.start()
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert [w for w, _ in results] == [0, 0], results
    for _, st in results:
        assert st["hits"] > 0 and set(st["misses"]) <= {"absent"}, st  # atomic writes: never a torn entry
    Tier(path, 12 * size, LAYOUT).make_room()
    assert Tier(path, 12 * size, LAYOUT).used_bytes() <= 12 * size


def test_a_tier_directory_naming_node_is_this_node_s_own(tmp_path):
    """``{node}`` in a tier's directory is the node's address (a directory per node on a shared file system);
    without an address to put there the tier refuses to open, naming the directory."""
    from actors.kv_tier import node_dir, open_tiers

    assert node_dir(str(tmp_path / "kv" / "{node}"), "10.0.0.7") == tmp_path / "kv" / "10.0.0.7"
    assert node_dir(str(tmp_path / "kv"), None) == tmp_path / "kv"
    spec = {"path": str(tmp_path / "{node}" / "mem"), "bytes": 1 << 20, "disk": str(tmp_path / "d-{node}"),
            "disk_bytes": 1 << 20, "layout": "L"}
    tiers = open_tiers(spec, "127.0.0.3")
    assert tiers.node.path == tmp_path / "127.0.0.3" / "mem" / "L" and tiers.disk.path == tmp_path / "d-127.0.0.3" / "L"
    with pytest.raises(ValueError, match=r"names \{node\}, and this process knows no node address"):
        open_tiers(spec, None)


def test_a_tier_rescans_after_a_sixteenth_of_its_entries_and_its_bound_holds(tmp_path, monkeypatch):
    """What one process knows of the tier's size is refreshed by a scan of the directory (every entry's stat): after
    ``rescan_every`` writes while the tier is small, after a sixteenth of the entries the last scan saw once that is
    more — so a large tier is not scanned every few writes — and at once when the process's own count says full."""
    size = entry_size(tmp_path)
    tier = Tier(tmp_path / "t", 1000 * size, LAYOUT, rescan_every=8)
    scans = []
    real = Tier._scan

    def counted(self, order=True):
        scans.append(order)
        return real(self, order)

    monkeypatch.setattr(Tier, "_scan", counted)
    data = tier.encode(b"k" * 16, block(torch.Generator().manual_seed(0)))
    for i in range(16):  # a small tier: every 8 writes
        tier.put_bytes(i.to_bytes(16, "little"), data)
    assert len(scans) == 2
    # another process's 400 entries in the same directory: seen at the next scan
    other = Tier(tmp_path / "t", 1000 * size, LAYOUT, rescan_every=8)
    for i in range(16, 416):
        other.put_bytes(i.to_bytes(16, "little"), data)
    scans.clear()
    for i in range(416, 424):
        tier.put_bytes(i.to_bytes(16, "little"), data)
    assert len(scans) == 1 and tier._entries == 424  # 8 writes after the last: this scan sees them all
    scans.clear()
    for i in range(424, 424 + 424 // 16 - 1):
        tier.put_bytes(i.to_bytes(16, "little"), data)
    assert scans == []  # 424 entries: the next scan after 26 writes, not 8
    tier.put_bytes((424 + 26).to_bytes(16, "little"), data)
    assert len(scans) == 1
    # its own count past the bound: a scan and evictions at once, down to the low-water mark
    small = Tier(tmp_path / "s", 40 * size, LAYOUT, rescan_every=8)
    for i in range(41):
        small.put_bytes(i.to_bytes(16, "little"), data)
    assert small.used_bytes() <= small.low_water and small.status()["evictions"] > 0
