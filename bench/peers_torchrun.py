"""What `bench/peers.py` runs as torchrun's worker (`torchrun ... -m bench.peers_torchrun ARGS`):
examples/digits/train.py as it is, without Unicron.

Under torchrun the Session joins the elastic agent's store as a client and keys its group by
the restart attempt (unicron/trainer/loop.py, join_first_group). Before it did, a restarted
group counted the dead attempt's ranks as arrived and failed with `Gloo connectFullMesh failed
... Connection refused` (seen here: 16 s and one of `--max-restarts` lost); this module then
gave each attempt a store of its own.
"""

from __future__ import annotations

import sys


def main() -> None:
    from examples.digits.train import main as train

    train(sys.argv[1:])


if __name__ == "__main__":
    main()
