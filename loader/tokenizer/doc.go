// Package tokenizer reads a Hugging Face tokenizer.json (and
// tokenizer_config.json) and encodes text to token ids and back exactly as
// the Hugging Face tokenizers library does, in pure Go.
//
// It implements the BPE model in both of its common forms: byte-level BPE
// (GPT-2, Llama 3, Qwen2: a ByteLevel pre-tokenizer and decoder) and
// SentencePiece-style BPE with byte fallback (Llama 2, TinyLlama, Mistral:
// ▁ for spaces, <0xXX> tokens for bytes outside the vocabulary). Added and
// special tokens are cut out of the text before anything else, as Hugging
// Face does; the post-processor (TemplateProcessing and the like) or the
// config's add_bos_token/add_eos_token say which special tokens
// Encode(text, true) adds.
//
// Supported components: normalizers Sequence, Prepend, Replace, Strip;
// pre-tokenizers ByteLevel, Metaspace, Split, Sequence, Digits,
// WhitespaceSplit, Punctuation; decoders ByteLevel, Metaspace, Replace,
// ByteFallback, Fuse, Strip, Sequence; post-processors TemplateProcessing,
// ByteLevel, RobertaProcessing, BertProcessing, Sequence. Anything else is
// an error at load time that names it and wraps ErrUnsupported; among
// those are the Unigram and WordPiece models and the Unicode normalizers
// (NFC, NFKC, ...), which need Unicode tables this package does not carry.
//
// The split expressions of GPT-2, Llama 3 and Qwen2 need a lookahead that
// Go's regexp lacks; they are matched by hand-written scanners. Other
// expressions (Split, Replace) are compiled with Go's regexp after \s, \d
// and \w are given the Unicode meaning they have in Oniguruma, the engine
// Hugging Face uses; ones Go cannot express (lookaround, \b) are rejected.
//
// Stream decodes generated ids one at a time, holding back text that the
// next ids may still change, so that what it returns adds up to Decode of
// all the ids.
//
// Example:
//
//	tok, err := tokenizer.Load(modelDir)
//	if err != nil {
//		return err
//	}
//	ids, err := tok.Encode("Hello, world!", true) // with BOS
//	if err != nil {
//		return err
//	}
//	st := tok.NewStream()
//	for _, id := range generated {
//		piece, err := st.Add(id)
//		if err != nil {
//			return err
//		}
//		fmt.Print(piece)
//	}
//	fmt.Print(st.Flush())
package tokenizer
