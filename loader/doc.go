// Package loader reads and writes Hugging Face Llama-family checkpoints:
// config.json (parsed by arch.ParseConfig), safetensors files (one
// model.safetensors, or shards listed in model.safetensors.index.json), and
// random-weight models made to order; and GGUF files, llama.cpp's format,
// with quantized weights.
//
// Open reads only the config and the safetensors headers, so opening a
// 100 GB model takes milliseconds and no memory; every header is validated
// (lengths, JSON, dtypes, shapes against byte spans, spans inside the file
// and not overlapping, index entries against the shards), and every tensor
// the architecture needs is checked against the config. Tensor bytes are
// read on demand by byte range, concurrently if the caller likes. A model
// file that is not a regular file (a named pipe, a device) is refused
// before it is opened. OpenFS opens a model inside an fs.FS (an embedded
// one) and reads it in place.
//
// The tensors are grouped into the layers the runtime pages, as arch lists
// them (arch.Config.LayerTensors): layer 0 is the embedding, layers 1..L
// the decoder blocks (model.layers.i.* in layer i+1), layer L+1 the final
// norm and LM head. The loader owns files; what a model of each family
// holds, and what its config means, is arch's.
//
//	m, err := loader.Open("/models/llama-2-7b")
//	if err != nil {
//		return err
//	}
//	defer m.Close()
//	for _, l := range m.Layers() {
//		fmt.Println(l, l.Bytes)
//	}
//	q, err := m.ReadTensor(ctx, "model.layers.0.self_attn.q_proj.weight")
//
// ShardedWriter writes safetensors shards and the index from tensors whose
// bytes a callback produces, and Synthesize uses it to write a random-weight
// model of any shape an arch.Config describes (arch.Preset names a few),
// deterministic by seed and fast enough to be disk-bound:
//
//	cfg, _ := arch.Preset("llama2-7b")
//	err := loader.Synthesize(ctx, dir, cfg, loader.SynthOptions{Seed: 1, MaxShardBytes: 2e9})
//
// Open also opens a GGUF file (v2 or v3) as a Model: GGUFConfig reads the
// config from its metadata (the llama architecture, which Mistral files
// share, and qwen2; others are refused by name), Model.Tokenizer builds
// the tokenizer of its tokenizer.ggml.* metadata, and its tensors take
// their Hugging Face names (gguf_names.go) and stored dtypes, F16, BF16,
// F32 or one of the quantized block formats. The query and key rows the
// llama converter permuted are put back in Hugging Face's order as they
// are read, so that layers, paging and the forward pass see the model a
// safetensors directory would give. WriteGGUFModel writes a model the way
// llama.cpp's converter and quantizer do (GGUFTensorTypes says which type
// each tensor takes), quantizing row by row as it writes;
// SynthesizeGGUF writes a random-weight one.
//
//	m, err := loader.Open("/models/llama-2-7b.Q4_K_M.gguf")
//
// Every file is written under a fresh temporary name and renamed into
// place when complete; a model directory is written as a whole
// (ReplaceModelDir), so a failure leaves the model that was there intact.
package loader
