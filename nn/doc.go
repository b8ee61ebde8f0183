// Package nn runs a Llama-family decoder: the forward pass with its KV
// cache and activation buffers (Model, Session, Pipeline across devices),
// training (Trainer, Params, the optimizers) and sampling. The forward pass
// also runs Qwen3's per-head q/k norms and the mixtures of experts of
// Mixtral, Qwen2-MoE and Qwen3-MoE (moe.go: the routing on the host, each
// expert run once per chunk on the tokens that chose it); training does
// not. When its Weights page experts one by one (ExpertWeights, a
// paging.Pager planned WithExpertCache), a sparse block acquires only the
// experts its tokens chose, and in a decode step guesses the next sparse
// block's from that block's router and prefetches them (ExpertGuesses
// counts how often the guess is right).
//
// A block runs through the fused operations of package tensor (RopeKV,
// AddRMSNorm, GateUpSiLU), which a backend may do in one pass each. On a
// backend with graphs (tensor.Grapher: the CUDA backend), a decode step
// replays graphs captured once (graph.go): one for each stretch of
// consecutive dense blocks whose layers are resident, one for each other
// dense block; the position is read from a session buffer, and a graph is
// captured again when what it baked in changes (the position's bucket,
// the layers' weight addresses).
// Model.SetGraphs turns that off; Session.GraphStats counts it.
//
// It owns the arithmetic of the model and the buffers it allocates. It asks
// arch for everything about the model's shape: the config (an
// *arch.Config, loader.Model.Config as it is), each layer's tensor names by
// role (arch.Config.LayerNames, LayerExperts) and the layer numbering its
// Weights use. It does not format a tensor name or switch on a family,
// read files (loader does), or decide what stays on the device (a
// paging.Server, which is a Weights as it is, does that under a budget).
//
//	lm, err := loader.Open(dir)
//	...
//	w, err := nn.LoadWeights(ctx, lm, b, nil) // or a paging.Pager
//	m, err := nn.New(lm.Config, b, nil, w)
//	s, err := m.NewSession(2048, 512)
//	logits, err := s.Forward(ctx, ids, false, nil)
package nn
