"""host_chunks: every chunk reaches the host whole, in order, each before the next is asked for.
On CPU the copies are plain; the pinned, overlapped CUDA path runs in scripts/gpu_check.py --checks."""

import torch

from pipeline_rl.trainer.host_staging import host_chunks


def test_chunks_arrive_in_order_with_their_bytes_counted():
    g = torch.Generator().manual_seed(0)
    chunks = [[(f"c{c}.t{i}", torch.randn(3 + c, 5, generator=g)) for i in range(2)] for c in range(4)]
    chunks.insert(2, [])  # a rank's empty share of a chunk is skipped
    asked = []

    def source():
        for i, chunk in enumerate(chunks):
            asked.append(i)
            yield chunk

    stats: dict[str, float] = {}
    seen = []
    nonempty = [i for i, c in enumerate(chunks) if c]
    for k, host in enumerate(host_chunks(source(), stats)):
        seen.append(host)
        assert asked[-1] == nonempty[k]  # handed out before the next device chunk is asked for
    expected = [dict(c) for c in chunks if c]
    assert [list(h) for h in seen] == [list(e) for e in expected]
    for host, device in zip(seen, expected):
        for name in host:
            assert torch.equal(host[name], device[name])
    assert stats["bytes"] == sum(t.numel() * 4 for c in chunks for _, t in c)
