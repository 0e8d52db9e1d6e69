"""GPU check: FlexAttention with the structural forest block mask equals dense-mask SDPA (bf16)."""
import torch
from torch.nn.attention.flex_attention import flex_attention

from arctic_core.batch import RolloutBatch
from arctic_zorro.forest import build_forest
from arctic_zorro.forest_attention import forest_block_mask

torch.manual_seed(0)
prompts = [torch.randint(3, 900, (int(n),)).tolist() for n in (700, 1500, 90)]
responses = [torch.randint(3, 900, (int(torch.randint(0, 400, (1,))),)).tolist() for _ in range(24)]
forest = build_forest(RolloutBatch.from_lists(prompts, responses, [i % 3 for i in range(24)]))
end, pos = forest.subtree_end.cuda(), forest.position_ids.cuda()
q, k, v = (torch.randn(1, h, forest.num_nodes, 128, device="cuda", dtype=torch.bfloat16) for h in (16, 8, 8))
out = torch.compile(flex_attention)(q, k, v, block_mask=forest_block_mask(end, pos), enable_gqa=True)
ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=forest.dense_mask().cuda(), enable_gqa=True)
print({"tokens": forest.num_nodes, "max_abs_diff_vs_sdpa": float((out - ref).abs().max())}, flush=True)
