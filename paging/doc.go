// Package paging runs a model whose weights do not fit on the device by
// paging layers between disk, host RAM and the device under a byte budget.
//
// The pieces:
//
//   - Budget is the budgeted allocator of one device. Every byte is charged
//     to a Category (resident weights, streamed weights, KV cache,
//     activations, workspace, gradients, and the blocks a caching allocator
//     keeps); the budget is never exceeded (allocations fail with an error
//     wrapping tensor.ErrOutOfMemory) and its peak is recorded. It
//     implements Allocator, which nn allocates from. On a backend with a
//     caching allocator it holds every device byte the process takes: the
//     block each allocation takes, the freed blocks kept for reuse, the
//     memory held outside allocations (the cuBLAS workspace).
//   - Evictor is how a Budget makes room: what holds evictable bytes (a
//     Pager's layers outside its ring) registers with the budget, which
//     evicts the least recently used bytes of all its evictors when a
//     charge does not fit.
//   - Plan decides before loading which weights stay resident, how large
//     the streaming ring is and how deep to prefetch, given the memory the
//     model's user reserves beside the weights (ModelInfo.Reserve); it
//     refuses a budget that cannot work and says the smallest one that can.
//   - PlanHybrid plans decode over the device, the link and the CPU at
//     once: of the layers that do not stay on the device, some are
//     computed on the CPU from host memory while the copies of the others
//     stream, the split chosen to minimise SimulateDecodeWith's prediction
//     from measured Rates (strategies hybrid and cpu), for a pager that
//     fills its ring (Options.PrefetchFill). Its device plan
//     streams the CPU's layers whole, for a prefill that runs every layer
//     on the device.
//   - Pager implements Acquire/Release over a Source: resident weights stay,
//     streamed weights pass through the ring (one allocation, the streamed
//     tensors views into it), the next layers of its sequence (every
//     layer, or those SetSequence gives) are prefetched while the current
//     one computes (with PrefetchFill, as many as the ring has room for,
//     while the caller computes elsewhere too), and a bounded host cache
//     (pinned when the backend can) saves re-reading the source; the parts
//     it cannot keep (every part, under the aggressive strategy) are read
//     on several goroutines into a small ring of pinned staging buffers
//     and copied asynchronously from there, a buffer reused once its
//     copies have landed (tensor.StagedUploader). A tensor two adjacent
//     layers share (tied embeddings: the head's weight is the embedding
//     table) is planned, moved and counted once, as the earlier layer's in
//     the walk (the head's), whose copy serves the next token's embedding
//     (LayerPlan.Shared). HostLayer hands the CPU a layer as host
//     tensors in that cache, kept there for the pager's life. Unified
//     serves the same from managed memory.
//   - Planned WithExpertCache, a mixture of experts (an ExpertSource)
//     pages each expert as a unit of its own: the layers without their
//     experts are placed first (their routers resident), the rest of the
//     budget is an expert cache of whole experts (one allocation of
//     slots), and AcquireExperts/ReleaseExperts/PrefetchExperts move
//     only the experts a step uses that the cache lacks, evicting by LRU
//     or aged LFU (ExpertPolicy). AcquireResident serves a layer's router
//     ahead of it, for guessing its experts. ExpertsOnCPU decides, by
//     Options.ExpertsCPU and the Rates, which of a layer's missing
//     experts the CPU computes instead of uploading (SplitMisses: those
//     whose product there ends before their upload), and HostExpert hands them over
//     as host tensors. AcquireExpertsLazy leaves the device's wait for
//     each missing expert's copies to the caller, so that cached experts
//     compute while the misses land. From a MappedSource the experts are
//     copied in place from the page-locked mapping (one copy an expert
//     where its tensors lie end to end) and HostExpert's tensors are views
//     of it: no host copy is read or pinned.
//   - Summary and WriteSnapshot show where the memory went;
//     examples/memviz draws a snapshot.
//
// What paging owns: the device bytes of one budget and their accounts, the
// residency of weights (which stay, which stream, which the CPU computes
// from host memory in decode, where in the ring they go, when they load),
// and the host copies of streamed weights. What it must not know: how the
// weights are computed with (it depends on the backend's memory and
// optional copy capabilities only, never its kernels; the speeds it plans
// with are Rates its user measures),
// the model's architecture beyond the layers and tensors a Source lists,
// and the user's buffers: the KV cache, activations and workspace are a
// Reserve the user describes buffer by buffer (nn.Reserve), never
// formulas of nn's layout kept here. It does not close what it did not
// make: whoever makes a Pager closes it before its Budget.
//
// Why a ring and not LRU: decoding walks the layers in the same order for
// every token, and an LRU cache smaller than the model evicts exactly the
// layer needed next. Keeping a fixed resident set and streaming the rest
// moves only the bytes that do not fit, per token. The ring's parts are
// laid out one after the other in the order they load, so that the walk
// only ever evicts the oldest parts and never fragments it; Plan sizes it
// for that layout, with at most one tensor's slack for the wrap.
//
// A short example, with src a Source, b a tensor.Memory and r the reserve
// of the model's user (nn.Reserve):
//
//	info := paging.ModelInfo{NumLayers: 32, Reserve: r}
//	info.Layers, _ = paging.DescribeSource(src)
//	limit, _ := paging.ParseSize("4GiB")
//	plan, err := paging.Plan(info, limit, paging.StrategyBalanced, 4096, 1, paging.WithDevice(b))
//	if err != nil {
//		return err // errors.Is(err, paging.ErrBudgetTooSmall) names the smallest budget
//	}
//	budget, err := paging.NewBudget(b, limit, "")
//	if err != nil {
//		return err
//	}
//	defer budget.Close()
//	pager, err := paging.NewPager(src, budget, plan, paging.Options{})
//	if err != nil {
//		return err
//	}
//	defer pager.Close() // before the budget's Close
//	w, err := pager.Acquire(ctx, 3) // map of tensor name to device tensor
//	...
//	pager.Release(3)
//	pager.MarkStep() // after each token: bytes moved per token
//	fmt.Print(budget.Summary())
//
// With the CPU computing part of the model in decode (rates measured by
// the user; hostLimit the host memory limit, 0 for none):
//
//	hp, err := paging.PlanHybrid(info, limit, 4096, 1, rates, paging.HybridOptions{HostBytes: hostLimit})
//	...
//	pager, err := paging.NewPager(src, budget, hp.GPU, paging.Options{HostLayers: hp.CPULayers, HostCacheBytes: hostLimit})
//	// prefill: every layer through Acquire, then for decode:
//	err = pager.SetSequence(hp.Sequence)
//	// each token, layer by layer: pager.HostLayer(ctx, l) for the layers
//	// in hp.CPULayers (host tensors for the CPU), Acquire/Release for
//	// the others
package paging
