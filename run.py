"""The chapter's demo: BlockManager operations, then contiguous vs paged utilization.

``python run.py`` prints the chapter's expected output (section 预期输出) character for
character. Every number is computed by ``spec``; only the demo's parameters are literals.
"""

from __future__ import annotations

from pagedkv.spec.block_manager import BlockManager
from pagedkv.spec.utilization import contiguous_usage, paged_usage

TOTAL_BLOCKS = 10
BLOCK_SIZE = 4
BLOCKS_TO_ALLOCATE = 2

NUM_REQUESTS = 8
MAX_LEN = 50
TOKENS_PER_REQUEST = 30
PAGED_BLOCK_SIZE = 16
RULE = "=" * 55


def demo_block_manager() -> list[str]:
    """Allocate a table, translate every position it can hold, free it."""
    manager = BlockManager(total_blocks=TOTAL_BLOCKS, block_size=BLOCK_SIZE)
    lines = [
        f"总 Block 数: {manager.total_blocks}，Block 大小: {manager.block_size}",
        f"初始空闲 Block 数: {manager.num_free_blocks}",
        "",
    ]
    table = manager.allocate(BLOCKS_TO_ALLOCATE)
    lines += [f"分配 {len(table)} 个 Block: {table}", f"剩余空闲: {manager.num_free_blocks}", ""]
    lines.append("逻辑位置 → 物理槽位翻译:")
    for pos in range(len(table) * manager.block_size):
        block_idx, slot_in_block = divmod(pos, manager.block_size)
        slot = manager.translate_slot(table, pos)
        lines.append(
            f"  逻辑位置 {pos} → Block[{block_idx}]={table[block_idx]} "
            f"slot {slot_in_block} → 物理槽位 {slot}"
        )
    manager.free(table)
    lines += ["", f"释放后空闲: {manager.num_free_blocks}", ""]
    return lines


def demo_utilization() -> tuple[list[str], bool]:
    """Compare reserving MAX_LEN slots per request with paged allocation; True if paged wins."""
    token_counts = [TOKENS_PER_REQUEST] * NUM_REQUESTS
    contiguous = contiguous_usage(token_counts, MAX_LEN)
    paged = paged_usage(token_counts, PAGED_BLOCK_SIZE)
    improved = paged.utilization > contiguous.utilization
    verdict = "✅" if improved else "❌"
    lines = [
        RULE,
        "显存利用率：连续分配 vs 分页分配",
        RULE,
        f"  连续分配: 每请求预留 {MAX_LEN} slots | 利用率 {contiguous.utilization:.0%}",
        f"  分页分配: 按需分配 Block（大小={PAGED_BLOCK_SIZE}）| 利用率 {paged.utilization:.0%}",
        "",
        f"  提升: {contiguous.utilization:.0%} → {paged.utilization:.0%}  {verdict}",
        "",
    ]
    return lines, improved


def main() -> int:
    utilization_lines, improved = demo_utilization()
    lines = demo_block_manager() + utilization_lines
    lines.append("✅ step12_paged_attention 通过" if improved else "❌ step12_paged_attention 失败")
    print("\n".join(lines))
    return 0 if improved else 1


if __name__ == "__main__":
    raise SystemExit(main())
