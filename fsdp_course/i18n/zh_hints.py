"""The Chinese of the checkers' most common problem and hint lines (see `fsdp_course.i18n.hint_zh`).

HINTS: (regular expression searched in a checker's English problem or hint line, Chinese template with \\1, \\2 ...
for its groups). The first that matches wins, so the more specific patterns come first; most are anchored at the
start of the line (`^`) on a phrase only that hint has. Numbers, names and shapes come from the English through the
groups. Vocabulary: the article's (分片, 本地分片, 全聚合, 归约分散, 全归约, 广播, 展平参数, 填充, 梯度, 优化器状态,
梯度裁剪, 原地); rank and world size stay English, code stays code. tests/test_checks_zh.py runs the planted mistakes
in Chinese and fails on a pattern that nothing uses.
"""

from __future__ import annotations

HINTS: list[tuple[str, str]] = [
    # -- shared: compare_tensor, exception_hint (every exercise) --------------------------------------------------
    (r"^rank (\d+)'s result is (\d+)x too small: did you average",
     r"rank \1 的结果只有应得值的 1/\2：是不是求了平均（op='mean' 或除以 world size），而不是求和？"),
    (r"^rank (\d+)'s result is (\d+)x too large: did you sum twice",
     r"rank \1 的结果是应得值的 \2 倍：是不是求和了两次（例如在 reduce_scatter 之上又做了一次 all_reduce）？"),
    (r"^shape differs: did you remove the padding\? keep only the first tensor\.numel\(\) \(here (\d+)\)",
     r"形状不对：去掉填充了吗？只保留全聚合结果的前 tensor.numel()（这里是 \1）个元素，再 reshape 成 tensor.shape"),
    (r"^that is one chunk: all_gather the reduced chunks",
     "这只是一个分块：对归约后的分块做 all_gather，让每个 rank 都拿到全部分块"),
    (r"^same number of elements, different shape",
     "元素个数相同，形状不同：reshape 成输入的形状（tensor.shape）"),
    (r"^shape differs: pad the flattened input",
     "形状不对：先填充展平后的输入，再从结果上去掉填充"),
    (r"^keep the input's dtype: pad with tensor\.new_zeros",
     "保持输入的 dtype：用 tensor.new_zeros(...) 而不是 torch.zeros(...) 来填充"),
    (r"^look at the first element that differs",
     "看第一个不同的元素，以及它落在哪个分块里（index // 分块大小）"),
    (r"^return the result tensor at the end of your function", "在函数末尾返回结果张量"),
    (r"^reduce_scatter needs a length that divides by ctx\.world_size",
     "reduce_scatter 要求长度能被 ctx.world_size 整除：先展平张量，再用零填充到 world size 的整数倍"),
    (r"^the ranks made different calls \(or used different shapes\): every rank must pad to the same length",
     "各 rank 的调用不一致（或形状不同）：每个 rank 都必须填充到相同长度，并以相同顺序调用相同的集合通信"),
    (r"^the ranks made different calls \(or used different shapes\)",
     "各 rank 的调用不一致（或形状不同）：每个 rank 都必须以相同的顺序、相同的形状调用相同的集合通信"),
    (r"^some rank skipped a collective that the others called",
     "有的 rank 跳过了其他 rank 调用的集合通信：每个 rank 都必须完成每一次调用"),
    (r"^the gathered tensor still has the padding",
     "全聚合得到的张量还带着填充：只保留前 tensor.numel() 个元素，再 reshape 成 tensor.shape"),
    (r"^a post-accumulate-grad hook must return None",
     "post-accumulate-grad 钩子必须返回 None：在一个什么都不返回的 def 里原地平均 p.grad"
     "（ctx.all_reduce(p.grad, op='mean') 是原地操作），不要用会返回结果的 lambda"),
    (r"^flatten the tensor with tensor\.reshape\(-1\) before the collectives",
     "在集合通信之前用 tensor.reshape(-1) 展平张量"),
    (r"^read the end of the traceback above",
     "看上面 traceback 的末尾：其中你代码的最后一行就是出错的地方"),
    (r"^rank (\d+): values differ$", r"rank \1：数值不对"),
    (r"^unit (\d+)'s gradient chunk differs from one process's$", r"单元 \1 的梯度分块与单进程的结果不同"),
    (r"^unit (\d+)'s parameter shard after the step differs from one process's$",
     r"更新之后，单元 \1 的参数分片与单进程的结果不同"),
    (r"^rank (\d+)'s gradient of `(.+)` differs from one process's$", r"rank \1 上 `\2` 的梯度与单进程的结果不同"),
    (r"^rank (\d+)'s `(.+)` after the step differs from one process's", r"更新之后，rank \1 上的 `\2` 与单进程的结果不同"),
    (r"^shard (\d+) after unscaling differs from one process's$", r"反缩放之后，分片 \1 与单进程的结果不同"),
    (r"^shard (\d+) after clipping differs from one process's$", r"裁剪之后，分片 \1 与单进程的结果不同"),
    (r"^the output differs from one process's$", "输出与单进程的结果不同"),
    (r"^rank (\d+): shape differs: got (.+), expected (.+)$", r"rank \1：形状不对：得到 \2，应为 \3"),
    (r"^rank (\d+) returned (\w+), not a tensor$", r"rank \1 返回了 \2，不是张量"),

    # -- 01 all-reduce and the ring ---------------------------------------------------------------------------
    (r"^build it from ctx\.reduce_scatter and ctx\.all_gather only",
     "只用 ctx.reduce_scatter 和 ctx.all_gather 来实现"),
    (r"^use ctx\.reduce_scatter \(sum the chunks\), then ctx\.all_gather",
     "先用 ctx.reduce_scatter（对各分块求和），再用 ctx.all_gather（把分块分享给所有 rank）"),
    (r"^an all-reduce returns the sum and leaves the caller's tensor as it was",
     "全归约返回总和，并保持调用者的张量不变（调用者可能还要用它）：在副本上计算，例如用 torch.cat 拼接展平的输入和"
     "填充，即使填充为空它也是新张量（reshape(-1) 和 chunk() 都是输入的视图）"),
    (r"^rank (\d+)'s result is right, but your function changed the tensor it was given",
     r"rank \1 的结果正确，但你的函数修改了传给它的张量"),
    (r"^every rank waited for its send to finish before posting its recv",
     "每个 rank 都在发出 recv 之前等待自己的 send 完成，所以没有 send 能完成：每一步先启动 send 而不等待"
     "（work = ctx.group.send([chunk], right, tag)），再 ctx.group.recv([incoming], left, tag).wait()，"
     "最后 work.wait()"),
    (r"^a rank finished while another still waited in a send or recv",
     "一个 rank 已经结束，另一个还在等待与它的 send 或 recv：每个 send 都需要对等方有匹配的 recv（相同 tag、"
     "相同元素个数），每个 recv 也都需要对应的 send"),
    (r"^a send or recv waited for a partner that never came",
     "一个 send 或 recv 在等一个永远不会来的对等方：每一步每个 rank 先启动 send（work = ctx.group.send([chunk], "
     "right, tag)），等待来自左边的 recv，再等待 send；rank r 发给 (r + 1) % N，从 (r - 1) % N 接收，tag 要匹配"),
    (r"^send and recv need contiguous tensors",
     "send 和 recv 需要连续的张量：使用一维缓冲区的分块（flat.chunk(n)）"),
    (r"^build it from ctx\.group\.send and ctx\.group\.recv only",
     "只用 ctx.group.send 和 ctx.group.recv 来实现：不用 ctx.all_reduce、ctx.reduce_scatter、ctx.all_gather "
     "或 ctx.broadcast"),
    (r"^in a ring, rank r sends only to its right neighbour \(r \+ 1\) % N \(here (\d+)\) and receives only from "
     r"its left neighbour \(r - 1\) % N \(here (\d+)\)",
     r"在环中，rank r 只发给右邻居 (r + 1) % N（这里是 \1），只从左邻居 (r - 1) % N（这里是 \2）接收"),
    (r"^too few messages: after the N - 1 reduce-scatter steps",
     "消息太少：N - 1 步归约分散之后，每个 rank 只持有一个完成的分块；还要再走 N - 1 步，把完成的分块沿环传递"
     "（全聚合那一半）"),
    (r"^each step sends one chunk \(padded numel / N elements\), not the whole tensor",
     "每一步只发送一个分块（填充后的 numel / N 个元素），而不是整个张量：N - 1 步归约分散，再 N - 1 步全聚合"),
    (r"^a ring all-reduce is N - 1 steps of reduce-scatter",
     "环形全归约是 N - 1 步归约分散加 N - 1 步全聚合，每步一个分块"),
    (r"^contributions are missing from a chunk: a recv overwrites its tensor.*; or the all-gather half sent chunks",
     "某个分块缺少一些 rank 的贡献：recv 会覆盖接收它的那个张量，所以在归约分散那一半要接收到单独的缓冲区再相加"
     "（chunk.add_(incoming)）；每个分块都要沿环走 N - 1 步，每步收集一份贡献。也可能是全聚合那一半发出了尚未完成的分块："
     "归约分散那一半结束后，rank r 持有分块 (r + 1) % N 的完整求和，它应最先发送这一块"),
    (r"^contributions are missing from a chunk: a recv overwrites its tensor",
     "某个分块缺少一些 rank 的贡献：recv 会覆盖接收它的那个张量，所以在归约分散那一半要接收到单独的缓冲区再相加"
     "（chunk.add_(incoming)）；每个分块都要沿环走 N - 1 步，每步收集一份贡献"),
    (r"^chunk (\d+) holds chunk (\d+)'s values: an index is off",
     r"分块 \1 里是分块 \2 的值：某个下标错了，最可能在全聚合那一半；从左邻居收到的分块，应放在邻居发送它时的那个下标"),
    (r"^a contribution was added twice", "有一份贡献被加了两次：在全聚合那一半，完成的分块应直接接收到原位，而不是再相加"),

    # -- 02 DDP -------------------------------------------------------------------------------------------------
    (r"^rank (\d+)'s `([^`]+)` still holds its own initial values",
     r"rank \1 的 `\2` 还是它自己的初始值：从 rank 0 原地广播每个参数"
     "（for p in model.parameters(): ctx.broadcast(p.data, src=0)）"),
    (r"^rank (\d+)'s `([^`]+)` holds rank (\d+)'s values: broadcast from src=0",
     r"rank \1 的 `\2` 是 rank \3 的值：从 src=0 广播"),
    (r"^that is the average of the ranks' values",
     "这是各 rank 值的平均：应广播 rank 0 的值（ctx.broadcast），而不是全归约"),
    (r"^copy into the existing parameters in place",
     "原地拷贝到已有的参数里（ctx.broadcast(p.data, src=0)）：在 model.parameters() 上建的优化器还持有旧参数"),
    (r"^rank (\d+)'s gradient is (\d+)x the one-process gradient: the hooks summed it",
     r"rank \1 的梯度是单进程梯度的 \2 倍：钩子对各 rank 求了和；应求平均（op='mean'，或除以 ctx.world_size）"),
    (r"^rank (\d+)'s gradient is its own slice's gradient, not averaged over the ranks",
     r"rank \1 的梯度只是它自己那份数据的梯度，没有在各 rank 间平均：给每个参数注册一个钩子，用 op='mean' "
     "全归约它的梯度（p.register_hook(...) 或 p.register_post_accumulate_grad_hook(...)）"),
    (r"^rank (\d+)'s gradient is (\d+)x too small: it was averaged twice",
     r"rank \1 的梯度只有应得值的 1/\2：平均了两次（op='mean' 之外又除以了 world size？）"),

    # -- 03 ZeRO memory, the budget ------------------------------------------------------------------------------
    (r"^Adam keeps two fp32 tensors per parameter",
     "Adam 为每个参数保存两个 fp32 张量（动量和方差）：每个参数 8 字节，不是 4"),
    (r"^those are elements, not bytes", "这些是元素个数，不是字节数：一个 fp32 值占 4 字节"),
    (r"^DDP does not shard the Adam state yet",
     "DDP 还不对 Adam 状态分片：stage 1 对优化器状态分片，stage 2 再加上梯度，stage 3 再加上参数"),
    (r"^ZeRO-1 shards the Adam state: each rank keeps 1/N",
     "ZeRO-1 对 Adam 状态分片：每个 rank 只保留 1/N；除以 world size（stage 1 及以上）"),
    (r"^ZeRO-1 shards some states over the N ranks",
     "ZeRO-1 把部分状态分片到 N 个 rank 上：被分片的部分要除以 N"),
    (r"^total is params \+ grads \+ optimizer", "total 是 params + grads + optimizer 之和"),
    (r"^return a dict with the keys", "返回一个 dict，键为 'params'、'grads'、'optimizer'、'total'（每个 rank 的字节数）"),
    (r"^you forgot the optimizer's state: Adam keeps two fp32 moments",
     "你漏掉了优化器状态：Adam 保存两个 fp32 矩，每个参数 8 字节（从 ZeRO-1 起在 N 个 rank 上分片）"),
    (r"^you forgot the optimizer's state",
     "你漏掉了优化器状态：Adam 每个参数占 8 字节（从 ZeRO-1 起分片）"),
    (r"^your ([\d,]+) B is the formula's ([\d,.]+) B rounded (?:down|up)",
     r"你的 \1 B 是公式的 \2 B 取整后的结果：Ψ / N 不一定是整数，所以用 / 而不是 // 或 round() 来除；"
     "检查器按百万分之一比较字节数，而不是按整字节"),
    (r"^that is (\S+)'s peak, not (\S+)'s",
     r"这是 \1 的峰值，不是 \2 的：ZeRO-1 对优化器状态分片，ZeRO-2 还对梯度分片，ZeRO-3 连参数也分片"
     "（并且一次全聚合一个分片单元）；检查你的阶段编号对哪些状态分片"),
    (r"^a boundary case: at N = (\d+) the device needs exactly ([\d,]+ B)",
     r"边界情况：N = \1 时设备恰好需要 \2，正好是全部容量，而峰值等于容量时放得下：比较时用 <=，不要用 <"),
    (r"^ZeRO-3 gathers one unit at a time",
     "ZeRO-3 一次全聚合一个单元：峰值时，最大单元的完整参数和完整梯度也在设备上，按该单元每个参数 8 字节计"),
    (r"^ZeRO-3 also holds the largest unit gathered with its gradient",
     "ZeRO-3 还要放下全聚合后的最大单元及其梯度：按该单元每个参数 8 字节计"),
    (r"^you kept the sharded parameters and gradients",
     "你把分片后的参数和梯度（8Ψ/N）留在了设备上：offload 会把它们连同 Adam 状态（共 16Ψ/N）一起移到主机；"
     "设备上只有全聚合的单元及其梯度，按该单元每个参数 8 字节计"),
    (r"^you counted the offloaded state against the device",
     "你把 offload 出去的状态算进了设备内存：offload 时分片后的参数、梯度和 Adam 状态（16Ψ/N 字节）都在主机上，"
     "设备上只有全聚合的单元及其梯度（按该单元每个参数 8 字节计）"),
    (r"^try N = 1, 2, 3 \.\.\. and return the first N",
     "依次尝试 N = 1, 2, 3 ...，返回第一个设备峰值放得下的 N；直到 64 都放不下时返回 None"),
    (r"^N = (\d+) fits, and your search never tried it: range\(1, \1\) stops at (\d+); try every N from 1 to \1 "
     r"\(range\(1, (\d+)\)\)",
     r"N = \1 放得下，但你的搜索从没试过它：range(1, \1) 止于 \2；要试 1 到 \1 的每个 N（range(1, \3)）"),
    (r"^the search is N = 1 to (\d+): when none of them fits, return None \(you went on to N = (\d+)\)",
     r"搜索范围是 N = 1 到 \1：都放不下时返回 None（你继续试到了 N = \2）"),
    (r"^your device_peak gives ([\d,]+ B) at N = (\d+), the formula ([\d,]+ B)",
     r"你的 device_peak 在 N = \2 时给出 \1，公式给出 \3：先修好 device_peak（check_device_peak 会指出错误），"
     "你的循环只是沿用它的结果"),
    (r"^a ring sends \(N - 1\)/N of the payload per rank",
     "环形算法中每个 rank 发送有效载荷的 (N - 1)/N，而不是全部：每个 rank 已经持有自己的分块，所以把用 N 的地方换成 N - 1"),
    (r"^DDP, ZeRO-1 and ZeRO-2 move 2 Psi \(N-1\)/N",
     "DDP、ZeRO-1 和 ZeRO-2 传输 2 Psi (N-1)/N（一次归约分散加一次全聚合，即一次全归约）；ZeRO-3 传输 "
     "3 Psi (N-1)/N（前向全聚合、反向再全聚合一次、归约分散）"),
    (r"^a ring all-gather or reduce-scatter over N ranks takes N - 1 steps, each paying alpha",
     "N 个 rank 上的环形全聚合或归约分散要走 N - 1 步，每步付出一次 alpha，每个 rank 发送有效载荷的 (N - 1)/N："
     "把用 N 的地方换成 N - 1"),
    (r"^the latency term is \(N-1\)x too small \((\d+)x here\)",
     r"延迟项只有应得值的 1/(N-1)（这里是 1/\1）：N 个 rank 上的环形全聚合或归约分散要走 N - 1 步，每步付出 alpha，"
     "所以每次集合通信的代价是 (N - 1) alpha，而不是 alpha"),
    (r"^the bandwidth term is units x too large \((\d+)x here\)",
     r"带宽项是应得值的 units 倍（这里是 \1 倍）：一个单元的有效载荷是 4Ψ/units 字节，不是整个模型的 4Ψ；"
     "units x 3 次集合通信每次只传一个单元"),
    (r"^each unit is its own collective", "每个单元各自做集合通信：共 units x 3 次，每次付出 (N - 1) alpha"),
    (r"^ZeRO-3 runs three collectives per unit and step",
     "ZeRO-3 每个单元每步做三次集合通信：前向一次全聚合，反向再一次（前向后单元已被释放），以及梯度的一次归约分散"),
    (r"^your prediction is too low", "你的预测太低了"),
    (r"^got ([\d,.]+ B), expected ([\d,.]+ B)$", r"得到 \1，应为 \2"),

    # -- 05 flat parameter -------------------------------------------------------------------------------------
    (r"^no padding: (\d+) elements over (\d+) ranks: pad with zeros to the next multiple of \2, "
     r"ceil\(\1 / \2\) \* \2 = (\d+)",
     r"没有填充：\1 个元素分给 \2 个 rank：用零填充到下一个 \2 的倍数，ceil(\1 / \2) * \2 = \3"),
    (r"^(\d+) elements over (\d+) ranks: pad with zeros to the next multiple of \2, ceil\(\1 / \2\) \* \2 = (\d+)",
     r"\1 个元素分给 \2 个 rank：用零填充到下一个 \2 的倍数，ceil(\1 / \2) * \2 = \3"),
    (r"^one rank holds everything, so there is nothing to pad: the flat tensor is the (\d+) elements",
     r"一个 rank 持有全部，所以无需填充：展平参数就是首尾相接的 \1 个元素（填充 (-numel) % world_size 个零，这里是 0）"),
    (r"^the padding must be zeros, at the end", "填充必须是零，且放在末尾（这样它的梯度为 0，不改变任何求和）"),
    (r"^right values, wrong order", "数值对，顺序错：按给定顺序把张量首尾相接，每个张量按行展开"),
    (r"^the flat tensor holds each tensor's values, in order", "展平参数依次包含每个张量的值（t.reshape(-1)），然后是零"),
    (r"^the flat tensor has (\d+) elements, expected (\d+)$", r"展平参数有 \1 个元素，应为 \2"),
    (r"^the flat tensor's values differ$", "展平参数的值不对"),
    (r"^rank (\d+)'s shard has (\d+) elements, the others (\d+): this is the article's bug\. "
     r"Every shard must have ceil\(numel / N\) = (\d+) elements",
     r"rank \1 的分片有 \2 个元素，其余的有 \3 个：这正是文章的 bug。每个分片都必须有 ceil(numel / N) = \4 个元素："
     "最后一个分片由填充补齐"),
    (r"^(\d+) / (\d+) is not whole: shards have ceil\(numel / N\) = (\d+) elements",
     r"\1 / \2 不是整数：分片应有 ceil(numel / N) = \3 个元素，而不是 floor(numel / N)，否则最后几个元素不属于任何 rank"),
    (r"^rank r's shard is \[r \* s, \(r \+ 1\) \* s\) with s = ceil\(numel / N\) = (\d+)",
     r"rank r 的分片是 [r * s, (r + 1) * s)，其中 s = ceil(numel / N) = \1：大小相等，按 rank 顺序，覆盖填充后的缓冲区"),
    (r"^flat\[a:b\]\.view\(shape\) shares flat's memory",
     "flat[a:b].view(shape) 与 flat 共享内存；torch.tensor(...)、.clone() 或 torch.cat 都会拷贝，"
     "之后全聚合到展平缓冲区就不再更新参数了"),
    (r"^tensor i starts where tensor i - 1 ended", "张量 i 从张量 i - 1 结束的位置开始：维护一个累加的偏移量"),
    (r"^return views of flat", "返回 flat 的视图（flat[a:b].view(shape)），而不是副本"),
    (r"^tensor (\d+) is a copy, not a view of the flat buffer$", r"张量 \1 是副本，不是展平缓冲区的视图"),

    # -- 06 the FSDP unit ----------------------------------------------------------------------------------------
    (r"^rank (\d+)'s gradient chunk is (\d+)x too large: did you average over the world size",
     r"rank \1 的梯度分块是应得值的 \2 倍：是否按 world size 取了平均（op='mean'）？"),
    (r"^rank (\d+)'s gradient chunk is half of one process's after two backward passes",
     r"两次反向之后，rank \1 的梯度分块只有单进程的一半：第二次覆盖了第一次的梯度；要像 autograd 那样累加："
     "self.shard.grad = chunk if self.shard.grad is None else self.shard.grad + chunk"),
    (r"^a unit's backward ran while its parameters were freed",
     "一个单元在参数已被释放时执行了反向：post_forward 必须让反向先调用 pre_backward"
     "（output.register_hook(lambda grad: self.pre_backward())），pre_backward 必须重新全聚合参数（self.unshard()）"),
    (r"^gather into self\.full\.data, not self\.full",
     "全聚合到 self.full.data，而不是 self.full：self.full 是 requires grad 的叶子张量（它的视图被保存用于反向），"
     "autograd 禁止原地写入它"),
    (r"^free them in post_forward", "在 post_forward 里释放它们：self.reshard()（self.full.untyped_storage().resize_(0)）"),
    (r"^after the reduce-scatter, drop it: self\.full\.grad = None",
     "归约分散之后丢掉它：self.full.grad = None（只保留分块）"),
    (r"^self\.shard\.grad must have the shard's shape",
     "self.shard.grad 必须是分片的形状（padded_numel // N,）：对 self.full.grad 做归约分散（op='mean'），"
     "让每个 rank 保留自己的分块"),
    (r"^make fresh views in every pre_forward",
     "在每次 pre_forward 里重新生成视图（self.set_params(self.layout.unflatten(self.full))）：之前前向留下的视图属于"
     "那次前向的 autograd 图；在 torch.no_grad()（评估）下生成的视图根本不带梯度"),
    (r"^after its forward, unit (\d+) still holds its gathered parameters",
     r"前向之后，单元 \1 仍持有全聚合的参数"),
    (r"^after backward, unit (\d+)'s full gradient \(self\.full\.grad\) is still alive",
     r"反向之后，单元 \1 的完整梯度（self.full.grad）仍然存在"),

    # -- 08 sharded checkpoint -----------------------------------------------------------------------------------
    (r"^save the world size in the metadata; in load, raise",
     "把 world size 存进元数据；load 时若它与 ctx.world_size 不同，就在每个 rank 上抛出异常（例如 ValueError）："
     "分片检查点是按 world size 切分的"),
    (r"^nothing tells a rank that the others have finished writing",
     "没有任何东西告诉一个 rank 其他 rank 已写完：save 末尾调用 ctx.barrier()，这样任何 rank 返回时检查点都已完整"),
    (r"^save every tensor of the dict as it is",
     "按原样保存 dict 里的每个张量（torch.save(state, path)），并在同一个 rank 上读回同一个文件"),
    (r"^(\w+) runs in a fresh process: it may use only its arguments and os, json, Path, torch",
     r"\1 在一个全新的进程里运行：只能使用它的参数以及 os、json、Path、torch"),

    # -- 10 distributed pitfalls ---------------------------------------------------------------------------------
    (r"^([\d.]+) is rank (\d+)'s own shard's norm: the article's bug",
     r"\1 是 rank \2 自己分片的范数：这是文章的 bug。要在所有 rank 上对各分片的范数平方求和"
     "（ctx.all_reduce，op='sum'），再开平方"),
    (r"^norms do not add up", "范数不能直接相加：全归约范数的平方（求和），再开平方"),
    (r"^that is sqrt\(mean of the squared norms\)", "这是 sqrt(范数平方的平均)：全归约平方时用 op='sum'，不是 'mean'"),
    (r"^the shards were not scaled: multiply each in place",
     "分片没有被缩放：对每个分片原地相乘（g.mul_(coef)），coef = max_norm / (norm + 1e-6)"),
    (r"^rank (\d+) scaled by max_norm / its own norm \(([\d.]+)\): the article's bug; every rank must scale by "
     r"max_norm / the global norm \(([\d.]+)\)",
     r"rank \1 用 max_norm / 它自己的范数（\2）缩放：这是文章的 bug；每个 rank 都必须用 max_norm / 全局范数（\3）缩放"),
    (r"^the global norm is below max_norm: clip only when it exceeds it",
     "全局范数低于 max_norm：只有超过时才做梯度裁剪（把系数限制在 1 以内）"),
    (r"^a rank made a collective that the others did not",
     "有一个 rank 做了其他 rank 没做的集合通信（集合通信写在了 `if ctx.rank == 0:` 下？）：每个 rank 都必须按相同"
     "顺序调用每个集合通信；在所有 rank 上计算，只在 rank 0 上打印"),
    (r"^the parameters moved (\d+)x as far as one process's at world size (\d+)",
     r"world size \2 时参数移动的距离是单进程的 \1 倍：梯度在各 rank 间求了和而不是平均；用 op='mean'（或除以 "
     "ctx.world_size）"),
    (r"^rank (\d+) returned its own slice's loss",
     r"rank \1 返回的是它自己那份数据的损失：在每个 rank 上全归约损失（op='mean'）得到全局损失"),

    # -- HSDP --------------------------------------------------------------------------------------------------
    (r"^the gradient is the mean over all ranks' slices", "梯度是所有 rank 数据的平均，与单进程的平均损失给出的一样"),
    (r"^after the reduce-scatter, all-reduce the shard \(op='mean'\) across mesh\.replicate",
     "归约分散之后，在 mesh.replicate 上全归约该分片（op='mean'），让每个副本都持有全部 R x S 个 rank 的平均"),
    (r"^all-reduce the reduced shard across mesh\.replicate",
     "在 mesh.replicate 上全归约归约后的分片：这个 rank 所在列的各 rank 持有同一个分片"),
    (r"^reduce-scatter in mesh\.shard \(the S ranks that split the gradient\), then all-reduce",
     "在 mesh.shard（切分梯度的 S 个 rank）中归约分散，再在 mesh.replicate（持有同一分片的 R 个 rank）中全归约"),
    (r"^reduce-scatter first, then all-reduce only the shard it returns",
     "先归约分散，再只对它返回的分片做全归约（FSDP2 的顺序）"),
    (r"^return the shard that mesh\.shard\.reduce_scatter gave this rank",
     "返回 mesh.shard.reduce_scatter 给这个 rank 的分片，而不是整个梯度"),

    # -- LoRA --------------------------------------------------------------------------------------------------
    (r"^B must start at zero",
     "B 必须从零开始（torch.zeros 或 nn.init.zeros_），这样更新量 B A x 恰好为零，适配后的模型起点就是预训练模型"),
    (r"^with A and B both zero", "A 和 B 都为零时，B 的梯度（(dL/dy) (A x)ᵀ）也为零，A 的也为零：什么都训练不了。"
     "A 要随机初始化，例如 nn.init.kaiming_uniform_(A, a=math.sqrt(5)) 或正态分布"),
    (r"^the update is not scaled: multiply B\(A x\) by alpha / rank \(here (.+)\)$",
     r"更新量没有缩放：把 B(A x) 乘以 alpha / rank（这里是 \1）"),
    (r"^A and B are swapped: B starts at zero",
     "A 和 B 弄反了：B 应从零开始（这样适配后的模型一开始就是预训练模型），A 应随机初始化"
     "（这样 B 的梯度 (dL/dy) (A x)ᵀ 从第一步起就不为零）"),
    (r"^the scaling is inverted: the update is multiplied by ([\d.]+) = rank / alpha.*; it is alpha / rank = ([\d.]+)",
     r"缩放反了：更新被乘以 \1 = rank / alpha（漏掉 alpha、只除以 rank 时也一样）；应为 alpha / rank = \2："
     "alpha 越大，适配器的更新越大"),
    (r"^the update is scaled by alpha: the scaling is alpha / rank \(here (.+)\)$",
     r"更新量按 alpha 缩放了：缩放系数应为 alpha / rank（这里是 \1）"),
    (r"^freeze the pretrained Linear", "冻结预训练的 Linear：self.base.requires_grad_(False)"),
    (r"^call self\.base\(x\) in forward",
     "在 forward 里调用 self.base(x)：FSDP 会把 base 的参数换成全聚合后展平参数的视图并清空原参数，所以在 __init__ "
     "里留下的张量（self.w = base.weight，或一个 detach 的副本）要么被清空，要么是每个 rank 上一份未分片的私有副本，"
     "加载的检查点也到不了它"),
    (r"^A maps the input down to `rank` values",
     "A 把输入降到 `rank` 个值：(rank, in_features)；B 再映射回去：(out_features, rank)"),
    (r"^make self\.lora_A = nn\.Parameter",
     "让 self.lora_A = nn.Parameter(...)：只有参数才会被 .parameters()、优化器和 FSDP 看到"),
    (r"^keep the Linear you were given as self\.base",
     "把传入的 Linear 保存为 self.base（不是副本，也不是新的 Linear）：它持有预训练权重"),
    (r"^use self\.lora_A in forward", "在 forward 里使用 self.lora_A，让它在通往输出的路径上"),
    (r"^leave the pretrained weights as they are",
     "保持预训练权重不变：只冻结它们（self.base.requires_grad_(False)），不要重新初始化"),
    (r"^the same forward on every rank", "每个 rank 上的 forward 都相同：forward 中不要有随机性，也不要在调用之间保存状态"),

    # -- mixed precision -------------------------------------------------------------------------------------------
    (r"^rank (\d+) would step while rank (\d+) skips: the decision was local",
     r"rank \1 会执行这一步，而 rank \2 会跳过：这是本地的决定。用 op='max' 全归约这个标志（每个 rank 都要调用，"
     "不论是否发现 inf），这样只要有一个 rank 发现 inf，所有 rank 都跳过"),
    (r"^an inf is found, a NaN is not", "inf 能被发现，NaN 不能：torch.isinf 漏掉了 NaN。用 ~torch.isfinite(g)，"
     "它对 inf、-inf 和 NaN 都为 True"),
    (r"^some ranks made a collective that others did not \(an all-reduce under `if found:`\?\)",
     "有的 rank 做了其他 rank 没做的集合通信（全归约写在了 `if found:` 下？）：每个 rank 都必须调用全归约，"
     "带上它的标志 0 或 1，不论是否发现 inf"),
    (r"^return a Python bool", "返回 Python 的 bool，例如 bool(flag.item())"),
    (r"^the shards were left scaled because an inf was found",
     "因为发现了 inf，这些分片没有被反缩放：约定是无论标志如何，都先原地除以缩放因子，再做检查，"
     "与 torch 的内核一样（GradScaler 先反缩放，再检查）"),
    (r"^the shards were not unscaled: divide each one in place",
     "分片没有反缩放：对每个分片原地相除（g.div_(scale) 或 g.mul_(1 / scale)）；新建张量（g = g / scale）"
     "不会改变优化器的 .grad"),
    (r"^multiplied by the scale: unscaling divides by it", "乘了 scale：反缩放应除以它（损失在反向之前被乘过）"),
    (r"^no rank found the inf in its own shards",
     "没有 rank 在自己的分片里发现 inf：相除之后用 torch.isfinite 检查每个分片（或查找 inf/NaN），再转成标志"),
    (r"^with every shard finite, return False",
     "所有分片都有限时返回 False：只有某个分片含 inf 或 NaN 时才返回 True（干净分片的 torch.isfinite(g).all() 为 True）"),
    (r"^this clean step is the (\d+)th in a row, which reaches growth_interval",
     r"这是连续第 \1 个干净步，达到了 growth_interval：scale 现在就翻倍。先计入这一步，再用 >=（或 ==）与 "
     "growth_interval 比较：用旧的计数比较，或者用 >，都会晚一步翻倍"),
    (r"^after a skipped step the count of clean steps starts again from 0", "跳过一步之后，干净步的计数从 0 重新开始"),
    (r"^when the scale grows, the count of clean steps starts again from 0", "scale 增长时，干净步的计数从 0 重新开始"),
    (r"^after a skipped step \(found_inf True\) the scale is multiplied by backoff_factor = ([\d.]+)",
     r"跳过一步（found_inf 为 True）之后，scale 乘以 backoff_factor = \1"),
    (r"^return \(new_scale, new_clean_steps\)", "返回 (new_scale, new_clean_steps)"),

    # -- model pitfalls --------------------------------------------------------------------------------------------
    (r"^the article's bug: x did not depend on i",
     "文章的 bug：x 不依赖于 i；为每个样本重新生成 id，例如一次性用 "
     "torch.randint(0, vocab, (n, seq), generator=generator)"),
    (r"^an Embedding takes integer ids: draw them", "Embedding 接受整数 id：用 torch.randint 生成，不要转成 float"),
    (r"^label each sample by its own ids", "用每个样本自己的 id 打标签：inputs.sum(dim=1) % 10"),
    (r"^one class index per sample, a 1-D tensor",
     "每个样本一个类别下标，是一维张量：F.cross_entropy 要求 targets 的形状为 (batch,)"),
    (r"^an Embedding\(vocab, d\) has rows 0 \.\. vocab - 1",
     "Embedding(vocab, d) 的行号是 0 .. vocab - 1：torch.randint(0, vocab, ...)"),
    (r"^draw the ids from the generator you are given", "用给你的 generator 生成 id：torch.randint(..., generator=generator)"),
    (r"^the encoder's output is \(seq, batch, d\) \(batch_first=False\)",
     "编码器的输出是 (seq, batch, d)（batch_first=False）：在序列维 dim 0 上取平均，每个样本得到一个向量"),
    (r"^token ids cast to float before the embedding",
     "token id 在进入嵌入层之前被转成了 float：Embedding 是按行查表的，直接给它整数 id（不要对 tokens 调用 .float()）"),
    (r"^a long \(integer\) tensor reached a Linear or the encoder",
     "一个 long（整数）张量进入了 Linear 或编码器：只有嵌入层接受 id；它的输出是 float，保持 float（不要 .long()）"),
    (r"^the encoder has batch_first=False",
     "编码器的 batch_first=False：在它之前把嵌入转置成 (seq, batch, d)（x.transpose(0, 1)），再在 dim 0 上池化"),
    (r"^cross_entropy wants one row of logits per sample",
     "cross_entropy 要求每个样本一行 logits：在 head 之前对序列取平均（编码器 (seq, batch, d) 的 dim 0）"),
    (r"^the article scales the embeddings by sqrt\(d_model\)",
     "文章在编码器之前把嵌入乘以 sqrt(d_model)：x = model.embedding(tokens) * model.scale"),
    (r"^pool with \.mean\(dim=0\)", "用 .mean(dim=0) 池化，与文章的 x.mean(0) 一样：求和会随序列长度增长"),
    (r"^write the path with the model's layers",
     "用模型的各层写出这条路径（model.embedding、model.encoder、model.fc）：检查器拿 model(tokens) 来比较"),
    (r"^return the head's output, model\.fc\(pooled\)", "返回 head 的输出 model.fc(pooled)"),
    (r"^leave the ids as they are: an Embedding takes integer ids",
     "保持 id 不变：Embedding 接受整数 id；不要原地做任何类型转换"),

    # -- overlap ------------------------------------------------------------------------------------------------
    (r"^issue it before computing: ctx\.all_gather\(shards\[(\d+)\], async_op=True\) before compute\((\d+), \.\.\.\)",
     r"在计算之前发起它：在 compute(\2, ...) 之前调用 ctx.all_gather(shards[\1], async_op=True)，"
     r"等到单元 \1 运行、即将使用时再 wait"),
    (r"^issue unit (\d+)'s all-gather with async_op=True before computing unit (\d+)",
     r"在计算单元 \2 之前用 async_op=True 发起单元 \1 的全聚合，只在单元 \1 需要参数之前才调用 wait()"),
    (r"^prefetch one unit ahead only",
     "只预取下一个单元（FSDP 的 prefetch=1）：在单元 i 即将计算时发起单元 i+1 的全聚合，而不是一开始就发起全部"),
    (r"^an async all-gather fills its output in the background",
     "异步全聚合在后台填充输出：使用参数之前调用 work.wait()，并使用它返回的结果"),
    (r"^keep each unit's CollectiveWork and wait for the right one",
     "保存每个单元的 CollectiveWork 并等待正确的那个：单元 i 的 wait() 返回单元 i 的参数"),
    (r"^work\.wait\(\) returns the gathered tensor", "work.wait() 返回全聚合后的张量：传入它的返回值"),
    (r"^there is no unit after the last one", "最后一个单元之后没有单元了：只有 i + 1 < len(shards) 时才发起下一个单元的全聚合"),
    (r"^return the last unit's output", "返回最后一个单元的输出（compute 对最后一个单元的返回值）"),
    (r"^call compute\(i, full, x\) once for every unit",
     "对每个单元按顺序调用一次 compute(i, full, x)，把每个输出作为下一个单元的 x 传下去"),

    # -- wrapping ---------------------------------------------------------------------------------------------
    (r"^take max\(numels\.values\(\)\), not the first unit", "取 max(numels.values())，而不是第一个单元"),
    (r"^wrap the module classes whose parameters would otherwise stay together",
     "包装那些参数否则会留在一起的模块类：每个编码器层，以及嵌入层（nn.Embedding），让根单元只保留最后的 norm 和 head"),
    (r"^wrap_policy\(\) returns a set of module classes",
     "wrap_policy() 返回一个模块类的集合，例如 {nn.TransformerEncoderLayer}：是类，不是实例或名字"),
    (r"^predicted_peak must be 16Ψ/N \+ 8 · largest", "对这些单元，predicted_peak 必须是 16Ψ/N + 8 · largest"),
    (r"^pad every unit to a multiple of the world size: (\d+) -> (\d+)",
     r"把每个单元填充到 world size 的整数倍：\1 -> \2（第 05 课）"),
    (r"^the parameters that no wrapped module owns \(here at least the head, fc\) form the root unit",
     "不属于任何被包装模块的参数（这里至少有 head，即 fc）组成根单元，名为 'root'：FSDP 总是最后包装模型本身"),
    (r"^a parameter belongs to its nearest wrapped ancestor only",
     "参数只属于离它最近的被包装祖先：根单元只拿到不属于任何被包装模块的参数"),
    (r"^a unit is named by its module's path in model\.named_modules\(\)",
     "单元以其模块在 model.named_modules() 中的路径命名（例如 'encoder.layers.0'）；被包装模块里面的被包装模块是"
     "一个独立的单元，模型本身是 'root'"),
    (r"^the root is a unit too \((\d+) elements here\)",
     r"根单元也是一个单元（这里有 \1 个元素），和其他每个单元一起被全聚合：在包括根单元在内的所有单元中取最大"),
    (r"^Ψ is the sum of every unit's padded size", "Ψ 是每个单元填充后大小之和，包括根单元"),
    (r"^each rank keeps 1/N of the parameters, gradients and Adam's state",
     "每个 rank 保留 1/N 的参数、梯度和 Adam 状态：16Ψ/N"),
    (r"^while the largest unit computes its gradient",
     "最大单元计算梯度时，同时持有全聚合的参数和完整梯度：每个元素 8 字节"),

    # -- ZeRO-2 buckets ----------------------------------------------------------------------------------------
    (r"^reduce-scatter with op='mean': ZeRO-2 averages the gradients",
     "用 op='mean' 做归约分散：ZeRO-2 与 DDP 一样在各 rank 间平均梯度"),
    (r"^after the loop over the gradients, the last bucket is still waiting",
     "遍历完梯度之后，最后一个桶还在等待：对其中剩下的部分（如果有）做归约分散，并追加它的分块"),
    (r"^rank r keeps chunk r: ctx\.reduce_scatter\(flat, op='mean'\) returns exactly this rank's chunk "
     r"\(after an all_reduce it would be flat\.chunk\((\d+)\)\[ctx\.rank\]\)",
     r"rank r 保留分块 r：ctx.reduce_scatter(flat, op='mean') 返回的正是这个 rank 的分块"
     r"（全归约之后则是 flat.chunk(\1)[ctx.rank]）"),
    (r"^collect gradients in a bucket while it holds at most bucket_numel elements",
     "在桶里最多不超过 bucket_numel 个元素时往里收集梯度，再对整个桶一次做归约分散：更少、更大的集合通信付出更少次延迟"),
    (r"^one reduce-scatter per bucket is all ZeRO-2 needs",
     "ZeRO-2 每个桶只需要一次归约分散：全归约发送两倍的字节，并让每个 rank 都拿到整个桶，而它只保留其中的 1/N"),
    (r"^reduce-scatter a bucket as soon as the next gradient does not fit into it",
     "一旦下一个梯度放不进桶，就对这个桶做归约分散，再开始新桶：ZeRO-2 一次只持有一个桶的完整梯度，而不是全部"),
    (r"^pad each bucket's flattened gradient with zeros to a multiple of ctx\.world_size",
     "在归约分散之前，用零把每个桶展平后的梯度填充到 ctx.world_size 的整数倍（torch.cat([flat, flat.new_zeros(pad)])）"),
    (r"^that is the whole bucket: reduce_scatter returns this rank's chunk",
     "这是整个桶：reduce_scatter 返回这个 rank 的分块，只保留它（不要对桶做全归约）"),
    (r"^a bucket takes gradients while it holds at most bucket_numel elements",
     "桶在元素不超过 bucket_numel 时接收梯度；会让它溢出的那个梯度开启下一个桶，大于 bucket_numel 的梯度单独成桶"),
    (r"^flatten the bucket's gradients in the order they arrived",
     "按梯度到达的顺序展平桶内梯度（torch.cat 各个 grad.reshape(-1)），在末尾补零，再做归约分散（mean）"),

    # -- DCP: cutting a flat shard into rows --------------------------------------------------------------------
    (r"^rows per rank are ceil\(d0 / N\) = ceil\((\d+) / (\d+)\) = (\d+)",
     r"每个 rank 的行数是 ceil(d0 / N) = ceil(\1 / \2) = \3，与 torch.chunk 的切法相同（最后的 rank 分得更少），"
     "而不是 d0 // N"),
    (r"^torch\.chunk\(p, N, dim=0\) returns fewer than N chunks when the first dimension is short: '([^']+)' has "
     r"d0 = (\d+) rows; over (\d+) ranks c = ceil\(\2 / \3\) = (\d+) rows each, so torch\.chunk gives (\d+) chunks "
     r"and rank (\d+) none",
     r"第一维较短时 torch.chunk(p, N, dim=0) 返回的分块少于 N 个：'\1' 有 d0 = \2 行；分给 \3 个 rank，"
     r"每个 c = ceil(\2 / \3) = \4 行，所以 torch.chunk 只给出 \5 个分块，rank \6 没有：给这样的 rank 一个空的 "
     "(0, *shape[1:]) 张量，例如 p[:0]，或者自己计算行范围"),
    (r"^keep the rows' shape: \((\d+), \*shape\[1:\]\)", r"保持行的形状：(\1, *shape[1:])，而不是一串展平的元素"),
    (r"^these are flat elements (\d+)-(\d+): you ignored info\.offset: '([^']+)' starts at flat element (\d+), "
     r"and this rank's rows of it are flat elements (\d+)-(\d+) .*If you cut flat into N equal pieces first",
     r"这些是展平元素 \1-\2：你忽略了 info.offset：'\3' 从展平元素 \4 开始，这个 rank 的那几行是展平元素 \5-\6"
     "（layout.unflatten(flat) 会在每个参数的偏移处把它切出来）。如果你先把 flat 切成 N 等份、再从本 rank 的那一份里读取："
     "那是第 5 课中 FSDP 的展平分片，而 Shard(0) 是把每个参数按它自己的行来切"),
    (r"^these are flat elements (\d+)-(\d+): you ignored info\.offset: '([^']+)' starts at flat element (\d+), "
     r"and this rank's rows of it are flat elements (\d+)-(\d+)",
     r"这些是展平元素 \1-\2：你忽略了 info.offset：'\3' 从展平元素 \4 开始，这个 rank 的那几行是展平元素 \5-\6"
     "（layout.unflatten(flat) 按偏移切出每个参数）"),
    (r"^these are flat elements (\d+)-(\d+), this rank's rows of '([^']+)' are flat elements (\d+)-(\d+)",
     r"这些是展平元素 \1-\2，这个 rank 的 '\3' 的行是展平元素 \4-\5"),
    (r"^return a copy \(\.clone\(\)\): a view keeps the whole gathered unit alive",
     "返回副本（.clone()）：视图会让整个全聚合的单元在释放后仍然存活，而逐个单元切分正是为了避免这一点"),
    (r"^return a list with one tensor per parameter, in layout\.infos order",
     "返回一个列表，每个参数一个张量，按 layout.infos 的顺序"),
    (r"^one tensor per parameter of layout\.infos",
     "layout.infos 的每个参数一个张量（flat 末尾的填充不是参数）"),
    (r"^cut each parameter on dim 0 \(rows\)",
     "按 dim 0（行）切分每个参数，与 fully_shard 的 Shard(0) 一样，而不是按展平元素切"),

    # -- 11 fully_shard ----------------------------------------------------------------------------------------
    (r"^bottom-up, as fully_shard's docs ask",
     "自底向上，如 fully_shard 文档所要求：先包每一层，最后 fully_shard(model)；先分片根模块会把所有参数放进一个单元"),
    (r"^finish with fully_shard\(model, mesh=mesh\)",
     "最后调用 fully_shard(model, mesh=mesh)：根单元持有不属于任何层的参数（嵌入、最后的 norm、head）；没有它，"
     "这些参数既不分片，也不在各 rank 间平均，各副本会逐渐分叉"),
    (r"^call fully_shard\(layer, mesh=mesh\) for every layer in model\.encoder\.layers before the model",
     "在模型之前，对 model.encoder.layers 中的每一层调用 fully_shard(layer, mesh=mesh)"),
    (r"^the course's units are the encoder layers and the root", "课程的单元是各编码器层和根单元，没有别的"),
    (r"^fully_shard\(layer, mesh=mesh\) for every layer, then fully_shard\(model, mesh=mesh\)",
     "对每一层调用 fully_shard(layer, mesh=mesh)，然后调用 fully_shard(model, mesh=mesh)"),
    (r"^the function runs in fresh processes, where only torch, nn and fully_shard are imported",
     "函数在全新的进程中运行，那里只导入了 torch、nn 和 fully_shard：它用到的其他东西要在函数内部导入"),
    (r"^shard every layer, then the model, with the default reshard_after_forward",
     "先分片每一层，再分片模型，使用默认的 reshard_after_forward（根单元保持全聚合，各层在反向时再全聚合一次）"),
    (r"^shard exactly the course's units, each with mesh=mesh and no other options",
     "只分片课程的这些单元，每个都用 mesh=mesh，不加其他选项"),
]
