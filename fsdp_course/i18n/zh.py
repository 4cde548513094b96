"""The Chinese of the course's figure texts (see `fsdp_course.i18n`; checker messages: `messages.py`).

TEXT: exact English figure text -> Chinese. PATTERNS: (regular expression matching a whole figure text, template
with \\1, \\2 ... for its groups). Vocabulary: the article's (分片, 全聚合 AllGather, 归约分散 ReduceScatter, ...).
Names from code (all_gather, op='sum', rank 3, Ψ) stay as they are: an entry that maps a text to itself says so.
Authors: run a lesson with FSDP_COURSE_I18N_MISSING=/tmp/missing.txt to list the figure texts not yet here.
"""

from __future__ import annotations

# what the memory categories and phases are called on a figure (legends, ticks)
_CATEGORIES = {
    "params": "参数（params）", "sharded_params": "分片参数", "gathered_params": "聚合后的参数",
    "grads": "梯度（grads）",
    "sharded_grads": "分片梯度", "optimizer": "优化器状态", "buffers": "缓冲区", "gathered": "聚合后的参数",
    "other": "其他", "total": "总计", "activations": "激活值", "measured": "实测",
}

TEXT: dict[str, str] = {
    **_CATEGORIES,
    # lesson 01: collectives
    "before": "之前", "after": "之后", "input": "输入", "padded input": "填充后的输入",
    "after: chunk r of the sum": "之后：和的第 r 块",
    "before: a full gradient each": "之前：每个 rank 一份完整梯度",
    "before: one shard each": "之前：每个 rank 一个分片",
    "bytes sent per rank / payload": "每个 rank 发送的字节数 / 有效载荷",
    "reduce_scatter of a padded tensor": "对填充后的张量做 reduce_scatter",
    "reduce_scatter, then all_gather": "先 reduce_scatter，再 all_gather",
    "ring cost per rank": "环形算法下每个 rank 的通信量",
    "world size N": "world size N（进程总数）",
    "bytes sent per rank (ring model)": "每个 rank 发送的字节数（环形模型）",
    "time per call (ms)": "每次调用耗时（ms）",
    "collectives timed on this machine (points) and steps·α + bytes·β (lines)":
        "本机实测的集合通信耗时（点）与 steps·α + bytes·β（线）",
    # fsdp_course.viz
    "milliseconds after the step's start": "自本步开始起的毫秒数",
    "Compute and communication per rank over one step": "一步之内每个 rank 的计算与通信",
    "owner rank": "所属 rank", "parameters": "参数", "padding": "填充",
    "phase (Ledger.mark label)": "阶段（Ledger.mark 的标签）",
    "Memory per rank over one step, measured at each event": "一步之内每个 rank 的内存（在每个事件处测量）",
    "Memory per rank over one step": "一步之内每个 rank 的内存",
    "MiB": "MiB",
    # lessons 02-07
    "one layer of the article's model": "文章模型的一层",
    "all_gather parameters": "all_gather 参数", "all_reduce gradients": "all_reduce 梯度",
    "reduce_scatter gradients": "reduce_scatter 梯度",
    "forward done": "前向传播结束", "backward done": "反向传播结束", "optimizer step": "优化器更新",
    "step starts": "本步开始", "init": "初始化",
    "forward": "前向传播", "backward": "反向传播",  # the phases on a memory timeline's axis
    "collectives per step (α-β fit)": "每步的集合通信（α-β 拟合）",
    "model state per rank (KiB)": "每个 rank 的模型状态（KiB）",
    "MB per rank": "每个 rank 的内存（MB）", "peak per rank, 16Ψ/N + 8U": "每个 rank 的峰值，16Ψ/N + 8U",
    "one unit per layer": "每层一个单元", "one unit": "一个单元",
    "parameters per unit, U": "每个单元的参数量 U",
    "seconds per step": "每步秒数",
    # lesson 08: the article's Transformer on real data
    "held-out accuracy": "留出集准确率", "held-out accuracy after each epoch": "每轮结束时的留出集准确率",
    "ln 10: a uniform guess": "ln 10：均匀随机猜测", "logistic regression on the bag": "像素袋上的逻辑回归",
    "loss (one process, batch of 64)": "损失（单进程，批大小 64）", "step": "步", "training loss": "训练损失",
    "no positions, post-norm": "无位置嵌入，post-norm", "no positions, pre-norm": "无位置嵌入，pre-norm",
    "positions, post-norm": "有位置嵌入，post-norm", "positions, pre-norm": "有位置嵌入，pre-norm",
    "the same pixels, scrambled": "同样的像素，打乱顺序", "after step": "优化器更新之后",
    "comm": "通信", "compute": "计算",
    "positions × pre-norm: the article's model (red), each fix alone, both (blue)":
        "位置嵌入 × pre-norm：文章的模型（红），各自单独修复，两者同时（蓝）",
}

PATTERNS: list[tuple[str, str]] = [
    # names from code, kept
    (r"rank \d+", r"\g<0>"),
    (r"op='\w+'", r"\g<0>"),
    (r"(all_gather|all_reduce|reduce_scatter|broadcast|barrier|unshard|reshard)(\(src=\d+\))?", r"\g<0>"),
    (r"all_gather, reduce_scatter: \(N-1\)/N", r"\g<0>"),
    (r"all_reduce: 2\(N-1\)/N", r"\g<0>"),
    (r"(\w+), N=(\d+)", r"\g<0>"),
    (r"DDP|FSDP|ZeRO-\d", r"\g<0>"),
    (r"(DDP|FSDP|ZeRO-\d): .*=.*", r"\g<0>"),  # a formula and its value
    (r"[\d.,]+ (B|KiB|MiB|GiB|TiB)", r"\g<0>"),
    (r"[\w.]*(weight|bias)( \([\d, ]*\))?", r"\g<0>"),  # a parameter's name (and shape)
    (r"(forward|pre_backward|post_backward): .+", r"\g<0>"),  # an FSDP event: phase, action, unit
    (r"(encoder\.)?layers\.\d+|root", r"\g<0>"),  # a unit's name
    (r"wrap=.*", r"\g<0>"),
    # lessons 09-13
    (r"(FSDP\(.*\)), (\d+) ranks, step (\d+)", r"\1，\2 个 rank，第 \3 步"),
    (r"Rank (\d+) of (\d+), one step: one unit vs one unit per layer", r"rank \1（共 \2 个），一步：一个单元 vs 每层一个单元"),
    (r"a test digit \(label (\d+)\)", r"一张测试数字图（标签 \1）"),
    (r"no positions: (\d+)   positions: (\d+)", r"无位置嵌入：\1   有位置嵌入：\2"),
    # lessons 02-07
    (r"(DDP|FSDP|ZeRO-\d) formula", r"\1 公式"),
    (r"(DDP|FSDP|ZeRO-\d) measured", r"\1 实测"),
    (r"(DDP|FSDP|ZeRO-\d) init", r"\1 初始化"),
    (r"(DDP|FSDP|ZeRO-\d) step (\d+)", r"\1 第 \2 步"),
    (r"step (\d+)", r"第 \1 步"),
    (r"batch (\d+)", r"批大小 \1"),
    (r"reduce_scatter bucket (\d+)", r"reduce_scatter 桶 \1"),
    (r"\(([\d, ]*)\) per rank, pad (\d+)", r"每个 rank (\1)，填充 \2"),
    (r"\(([\d, ]*)\) per rank", r"每个 rank (\1)"),
    (r"FSDP, (\d+) ranks: parameters \+ gradients \+ optimizer state at each event of step (\d+)",
     r"FSDP，\1 个 rank：第 \2 步每个事件处的参数 + 梯度 + 优化器状态"),
    (r"One process, small Transformer \(Ψ = (\d+)\): memory by kind", r"单进程、小型 Transformer（Ψ = \1）：各类内存"),
    (r"Small Transformer, Ψ = (\d+), (.+), (.+)", r"小型 Transformer，Ψ = \1，\2，\3"),
    (r"the article's model cut into equal units, N = (\d+): time on this machine's α, β, and memory",
     r"文章的模型切成大小相等的单元，N = \1：按本机 α、β 估算的时间，以及内存"),
    (r"rank (\d+) over step (\d+), N = (\d+): the whole model as one unit, and one unit per layer",
     r"rank \1 在第 \2 步（N = \3）：整个模型作为一个单元，与每层一个单元"),
    (r"the root unit when every encoder layer is wrapped, (\d+) ranks", r"每个编码器层都被包装时的根单元，\1 个 rank"),
    # fsdp_course.viz
    (r"forward compute", "前向计算"),
    (r"backward compute", "反向计算"),
    (r"(.+) compute", r"\1 计算"),
    (r"rank (\d+): all-gathers run ([\d.]+) ms, ([\d.]+) ms of it while a unit computes",
     r"rank \1：全聚合共 \2 ms，其中 \3 ms 与某个单元的计算重叠"),
    (r"rank (\d+): collectives run ([\d.]+) ms, ([\d.]+) ms of it while a unit computes",
     r"rank \1：集合通信共 \2 ms，其中 \3 ms 与某个单元的计算重叠"),
    (r"bytes \((\w+)\)", r"字节（\1）"),
    (r"ranks ([\d, ]+) \(equal\)", r"rank \1（相同）"),
    (r"peak (.+)", r"峰值 \1"),
    (r"Memory per rank over one step \(rank (\d+)\)", r"一步之内每个 rank 的内存（rank \1）"),
    (r"element of the flat parameter: (\d+) elements \+ (\d+) padding = (\d+) shards x (\d+) \((.+) per rank\)",
     r"展平参数的元素：\1 个元素 + \2 个填充元素 = \3 个分片 × \4（每个 rank \5）"),
    (r"Flat parameter of unit '(.+)': (\d+) parameters(.*), (\d+) ranks",
     r"单元 '\1' 的展平参数：\2 个参数\3，\4 个 rank"),
    (r"Flat parameter: (\d+) parameters(.*), (\d+) ranks", r"展平参数：\1 个参数\2，\3 个 rank"),
    (r"dim 0 of each parameter, padded to (\d+) x ceil\(dim0 / (\d+)\) rows: (\d+) elements \+ (\d+) padding = "
     r"(\d+) ranks x (\d+) \((.+) per rank\)",
     r"每个参数的第 0 维，填充到 \1 × ceil(dim0 / \2) 行：\3 个元素 + \4 个填充元素 = \5 个 rank × \6（每个 rank \7）"),
    (r"Per-parameter shards on dim 0 \(FSDP2\): (\d+) parameters(.*), (\d+) ranks",
     r"按参数在第 0 维分片（FSDP2）：\1 个参数\2，\3 个 rank"),
    (r"Bytes sent by rank (\d+) per phase \(ring model, N = (\d+), payload = (.+)\)",
     r"rank \1 在每个阶段发送的字节数（环形模型，N = \2，有效载荷 = \3）"),
    (r"Bytes received by rank (\d+) per phase \(ring model, N = (\d+), payload = (.+)\)",
     r"rank \1 在每个阶段接收的字节数（环形模型，N = \2，有效载荷 = \3）"),
    (r"Model state per rank: Ψ = ([\d,]+) parameters, N = (\d+), (.+), (\d+) bytes per value",
     r"每个 rank 的模型状态：Ψ = \1 个参数，N = \2，\3，每个值 \4 字节"),
    (r"(.+)\nmeasured", r"\1\n实测"),
]
