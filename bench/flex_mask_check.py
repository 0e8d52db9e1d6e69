"""GPU check: the forest attention's FlexAttention path (q/k/v padded to ``padded_length``, the
structural block mask, the backend's compiled kernels) against dense-mask SDPA in fp32, forward and
backward, for packed lengths in two padded lengths (fixed-shape kernels) and past the fixed-shape
budget (kernels for any length)."""
import json

import torch

from arctic_core.batch import RolloutBatch
from arctic_zorro import forest_attention
from arctic_zorro.forest import build_forest
from arctic_zorro.forest_attention import ForestAttentionMeta, padded_length


def check(prompt_lens: tuple[int, ...], samples: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 900, (n,), generator=gen).tolist() for n in prompt_lens]
    responses = [torch.randint(3, 900, (int(torch.randint(0, 400, (1,), generator=gen)),), generator=gen).tolist()
                 for _ in range(samples * len(prompts))]
    forest = build_forest(RolloutBatch.from_lists(prompts, responses,
                                                  [i % len(prompts) for i in range(len(responses))]))
    forest = forest.to("cuda")
    # As the projections give them: [1, T, H, D] in memory, seen as [1, H, T, D].
    q, k, v = (torch.randn(1, forest.num_nodes, h, 128, device="cuda").transpose(1, 2) for h in (16, 8, 8))
    weights = torch.randn(1, forest.num_nodes, 16, 128, device="cuda")
    results = []
    for dtype, use_flex in ((torch.bfloat16, True), (torch.float32, False)):
        inputs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        meta = ForestAttentionMeta(forest, use_flex=use_flex)
        out, _ = forest_attention.forest_attention(None, *inputs, None, forest=meta)
        grads = torch.autograd.grad((out.float() * weights).sum(), inputs)
        results.append((out.float(), [g.float() for g in grads]))
    (out, grads), (ref, ref_grads) = results
    return {"tokens": forest.num_nodes, "padded": padded_length(forest.num_nodes),
            "max_abs_diff_vs_fp32_sdpa": round(float((out - ref).abs().max()), 4),
            "grad_max_rel_diff": [round(float((g - r).abs().max() / r.abs().max()), 4)
                                  for g, r in zip(grads, ref_grads, strict=True)]}


if __name__ == "__main__":
    kernels = forest_attention.FlexKernels(static_lengths=2)  # the third padded length takes kernels for any length
    forest_attention.flex_kernels = lambda: kernels
    for seed, (prompts, samples) in enumerate([((700, 1500, 90), 8), ((700, 1500, 90), 8), ((2000, 300), 8),
                                                ((3000, 1000, 500), 8)]):
        print(json.dumps(check(prompts, samples, seed)), flush=True)
    print(json.dumps({"fixed_shape_keys": sorted(str(k) for k in kernels.fixed_keys)}))
