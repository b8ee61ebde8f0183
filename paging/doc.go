// Package paging runs a model whose weights do not fit on the device by
// paging layers between disk, host RAM and the device under a byte budget.
//
// The pieces:
//
//   - Budget is the budgeted allocator of one device. Every byte is charged
//     to a Category (resident weights, streamed weights, KV cache,
//     activations, workspace); the budget is never exceeded (allocations
//     fail with an error wrapping tensor.ErrOutOfMemory) and its peak is
//     recorded. It implements Allocator, which nn allocates from.
//   - Plan decides before loading which weights stay resident, how large
//     the streaming ring is and how deep to prefetch, given the KV cache and
//     activations nn will allocate; it refuses a budget that cannot work
//     and says the smallest one that can.
//   - Pager implements Acquire/Release over a Source: resident weights stay,
//     streamed weights pass through the ring, the next layers are prefetched
//     while the current one computes, and a bounded host cache (pinned when
//     the backend can) saves re-reading the source.
//   - Summary and WriteSnapshot show where the memory went;
//     examples/memviz draws a snapshot.
//
// Why a ring and not LRU: decoding walks the layers in the same order for
// every token, and an LRU cache smaller than the model evicts exactly the
// layer needed next. Keeping a fixed resident set and streaming the rest
// moves only the bytes that do not fit, per token.
//
// A short example, with src a Source, b a tensor.Memory and r the reserve
// of the model's user (nn.Config.Reserve):
//
//	info := paging.ModelInfo{NumLayers: 32, Reserve: r}
//	info.Layers, _ = paging.DescribeSource(src)
//	limit, _ := paging.ParseSize("4GiB")
//	plan, err := paging.Plan(info, limit, paging.StrategyBalanced, 4096, 1)
//	if err != nil {
//		return err // errors.Is(err, paging.ErrBudgetTooSmall) names the smallest budget
//	}
//	budget := paging.NewBudget(b, limit, "")
//	defer budget.Close()
//	pager, err := paging.NewPager(src, budget, plan, paging.Options{})
//	if err != nil {
//		return err
//	}
//	w, err := pager.Acquire(ctx, 3) // map of tensor name to device tensor
//	...
//	pager.Release(3)
//	pager.MarkStep() // after each token: bytes moved per token
//	fmt.Print(budget.Summary())
package paging
