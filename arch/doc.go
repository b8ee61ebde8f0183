// Package arch is the one place that knows model families: what a model of
// each family looks like, as data. The loader, the forward pass and the
// planner ask it; none of them formats a tensor name or switches on a
// family.
//
// It owns:
//
//   - The config: Config is the one description of a model, parsed from a
//     Hugging Face config.json by ParseConfig (with the defaults of the
//     family's transformers class) and written back by MarshalJSON; the
//     forward pass reads it as it is. Validate is the one set of rules a
//     config must meet. Preset names a few shapes for synthetic models.
//   - The families and their quirks: Family (Llama, Mistral, Qwen2, Qwen3,
//     and the mixtures of experts Mixtral, Qwen2-MoE, Qwen3-MoE) and one
//     table of what sets each apart: which projections carry biases, whether
//     a sliding window applies, per-head q/k norms (Config.QKNorm), the
//     layout of the experts (Config.MoE: which blocks are sparse, the
//     router, the routed experts and a shared one), the defaults of the
//     family's transformers config. Fields of routing schemes strata does
//     not run (a sigmoid score, grouped top-k...) are refused by name.
//   - The rotary embedding's frequencies (InvFreq, RopeTables, llama3
//     scaling) and the context a model can run (ContextLength).
//   - Tensor names, roles and shapes: Role says what a tensor does (Q,
//     OBias, MLPNorm, LMHead, Router, ExpertUp...); BlockTensors,
//     LayerTensors and ExpectedTensors give each tensor's Spec (name, role,
//     shape, and the expert of an expert's projection), LayerNames the name
//     of each role in a layer and LayerExperts those of each routed expert,
//     which is how the forward pass finds its weights. A sparse block is one
//     layer; each expert's tensors are told apart by role and expert index
//     (ExpertTensors), so that they can be paged one expert at a time.
//   - The layer numbering, the units the runtime loads, pages and places:
//     layer 0 is the embedding, layers 1..NumLayers the decoder blocks,
//     layer NumLayers+1 the final norm and LM head, which with tied
//     embeddings is the embedding table (LayerCount, LayerKind, BlockLayer,
//     HeadLayer).
//
// It must not know files (the loader reads config.json and the weights, and
// fills a Config from a GGUF file's metadata: loader.GGUFConfig), devices,
// kernels or buffers (nn), or budgets and paging (paging): of this module
// it imports only tensor, for dtypes and shapes, and internal/oneline for
// messages.
//
//	cfg, err := arch.ParseConfig(data) // data: the bytes of config.json
//	if err != nil {
//		return err // wraps arch.ErrConfig
//	}
//	for l := range cfg.LayerCount() {
//		for _, s := range cfg.LayerTensors(l) {
//			fmt.Println(l, s.Role, s.Name, s.Shape)
//		}
//	}
//	q := cfg.LayerNames(cfg.BlockLayer(0))[arch.Q] // "model.layers.0.self_attn.q_proj.weight"
package arch
