"""Cost model of the fused W13 + W2 kernel's schedule (run 36): every W13 tile takes c13 us,
every W2 tile c2 us (tile times read off the one-GPU micro-benchmark), a W2 tile starts only
once the W13 tiles of its row block have ended. Prints, per lag, the end of the last program
and the mean wait per program, for the static round robin (position t on program t mod G)
and for run-time hand-out (each position to the program that frees up first).

    PYTHONPATH=src python3 schedule_model.py
"""
import heapq

from distmoe.kernels._common import fused_schedule_ref

G = 132


def block_of(i: int, num_pid_m: int, n: int, group_m: int) -> int:
    """Row block of tile ``i`` in group-M order (``_common.swizzle_tile``)."""
    first = i // (group_m * n) * group_m
    return first + (i % (group_m * n)) % min(num_pid_m - first, group_m)


def simulate(blocks, n13, n2, c13, c2, group_m, lag, dynamic):
    done13 = {}
    free = [(0.0, p) for p in range(G)]
    busy = [0.0] * G
    wait = 0.0
    for t, (w2, i) in enumerate(fused_schedule_ref(blocks, n13, n2, group_m, lag)):
        if dynamic:
            start, p = heapq.heappop(free)
        else:
            p, start = t % G, busy[t % G]
        if w2:
            ready = done13[block_of(i, blocks, n2, group_m)]
            wait += max(0.0, ready - start)
            end = max(start, ready) + c2
        else:
            end = start + c13
            b = block_of(i, blocks, n13, group_m)
            done13[b] = max(done13.get(b, 0.0), end)
        if dynamic:
            heapq.heappush(free, (end, p))
        else:
            busy[p] = end
    last = max(f for f, _ in free) if dynamic else max(busy)
    return last, wait / G


# fine at EP=2: 256 row blocks; ping-pong 12 W13 / 16 W2 tiles a block, cooperative 6 / 8
for name, (n13, n2, c13, c2) in {"ping-pong": (12, 16, 14.0, 5.2),
                                  "cooperative": (6, 8, 28.0, 11.5)}.items():
    for lag in (1, 2, 3, 4):
        s_end, s_wait = simulate(256, n13, n2, c13, c2, 8, lag, False)
        d_end, d_wait = simulate(256, n13, n2, c13, c2, 8, lag, True)
        print(f"{name:11s} lag {lag}: static end {s_end:.0f} us, wait {s_wait:.1f} us/program;"
              f" run-time hand-out end {d_end:.0f}, wait {d_wait:.1f}")
