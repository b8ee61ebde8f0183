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
//   - The families and their quirks: Family (Llama, Mistral, Qwen2) and one
//     table of what sets each apart: which projections carry biases, whether
//     a sliding window applies, the default context. The quirks of the
//     families to come have their place in Config (QKNorm for Qwen3, MoE for
//     the mixtures of experts) and in the table; until a family has them,
//     Validate refuses them.
//   - The rotary embedding's frequencies (InvFreq, RopeTables, llama3
//     scaling) and the context a model can run (ContextLength).
//   - Tensor names, roles and shapes: Role says what a tensor does (Q,
//     OBias, MLPNorm, LMHead...); BlockTensors, LayerTensors and
//     ExpectedTensors give each tensor's Spec (name, role, shape), and
//     LayerNames the name of each role in a layer, which is how the forward
//     pass finds its weights.
//   - The layer numbering, the units the runtime loads, pages and places:
//     layer 0 is the embedding, layers 1..NumLayers the decoder blocks,
//     layer NumLayers+1 the final norm and LM head, which with tied
//     embeddings is the embedding table (LayerCount, LayerKind, BlockLayer,
//     HeadLayer).
//
// It must not know files (the loader reads config.json and the weights, and
// a GGUF reader will fill a Config from its metadata), devices, kernels or
// buffers (nn), or budgets and paging (paging): of this module it imports
// only tensor, for dtypes and shapes, and internal/oneline for messages.
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
