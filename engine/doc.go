// Package engine assembles a runnable model: it opens the devices, decides
// each device's budget, places the layers, plans residency and streaming,
// makes the budgets and the servers that page the weights, loads the
// resident set and makes sessions; Close takes it all down in the right
// order. It is the only place that does so: the commands (generate, bench,
// finetune, and the server and hybrid placement to come) and library users
// call it, so one policy holds everywhere.
//
// The policy when no budget is given: a device with a memory of its own (a
// GPU) gets its free memory at Open less a headroom of 1/32 of it (at least
// 256 MiB) for the driver, other libraries and fragmentation; the CPU gets
// no limit. The offload strategy is then "none" (everything resident) if
// no budget was given for any device, and "balanced" otherwise.
//
// A mixture of experts in explicit memory pages its experts one by one
// (paging.WithExpertCache): each device keeps its other weights as the
// strategy says and caches what experts the rest of its budget holds;
// Experts reports the caches.
//
// What it owns: the order of assembly and teardown, the default budget
// policy, the warm-up that loads the resident layers. What it must not
// know: file formats (loader), a family's tensors (arch), kernels
// (tensor, cuda), how a plan is made (paging) or how a block computes (nn).
//
// A short example:
//
//	lm, _ := loader.Open("models/TinyLlama-1.1B")
//	defer lm.Close()
//	e, err := engine.Open(ctx, lm, engine.Options{
//		Devices: []string{"cuda"},
//		Memory:  engine.Memory{Budgets: []int64{4 << 30}},
//	})
//	if err != nil {
//		return err
//	}
//	defer e.Close()
//	s, _ := e.NewSession()
//	defer s.Close()
//	logits, _ := s.Forward(ctx, promptIDs, false, nil)
package engine
