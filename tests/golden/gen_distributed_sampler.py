# Golden index lists of torch.utils.data.DistributedSampler for tests/nn/dataloader_spec.lua.
#   /usr/bin/python3 tests/golden/gen_distributed_sampler.py > tests/golden/distributed_sampler.json
# For each case: the epoch's order torch draws (randperm from a generator seeded with seed + epoch,
# or 0..n-1 unshuffled) and every rank's list. torch's RNG is not fsdp's, so the spec checks that
# its plain-Lua reference of the algorithm, applied to torch's order, gives torch's lists, and that
# fsdp.data.DistributedSampler gives that reference applied to fsdp's own order. 0-based indices.
import json
import torch
from torch.utils.data import DistributedSampler

cases = []
for n in (0, 1, 5, 7, 10, 12, 13):
    for replicas in (1, 2, 3, 4, 8):
        for drop_last in (False, True):
            for shuffle in (False, True):
                for seed, epoch in ((0, 0), (3, 2)):
                    if not shuffle and (seed, epoch) != (0, 0):
                        continue
                    if n == 0 and not drop_last:
                        continue  # torch pads from an empty list: a ZeroDivisionError
                    ds = list(range(n))
                    if shuffle:
                        g = torch.Generator()
                        g.manual_seed(seed + epoch)
                        order = torch.randperm(n, generator=g).tolist()
                    else:
                        order = list(range(n))
                    ranks = []
                    for r in range(replicas):
                        s = DistributedSampler(ds, num_replicas=replicas, rank=r, shuffle=shuffle, seed=seed,
                                               drop_last=drop_last)
                        s.set_epoch(epoch)
                        ranks.append(list(iter(s)))
                        assert len(ranks[-1]) == len(s)
                    cases.append({"n": n, "num_replicas": replicas, "drop_last": drop_last, "shuffle": shuffle,
                                  "seed": seed, "epoch": epoch, "order": order, "ranks": ranks})
print(json.dumps({"torch": torch.__version__, "cases": cases}, separators=(",", ":")))
