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
// Supported components: normalizers Sequence, Prepend, Replace, Strip, NFC,
// NFD, NFKC, NFKD; pre-tokenizers ByteLevel, Metaspace, Split, Sequence,
// Digits, WhitespaceSplit, Punctuation; decoders ByteLevel, Metaspace,
// Replace, ByteFallback, Fuse, Strip, Sequence; post-processors
// TemplateProcessing, ByteLevel, RobertaProcessing, BertProcessing,
// Sequence. Anything else is an error at load time that names it and wraps
// ErrUnsupported; among those are the Unigram and WordPiece models.
//
// The Unicode normalizers are exact also past 30 combining marks in a row,
// where golang.org/x/text's stream-safe format would insert U+034F.
//
// Hugging Face compiles split and replace expressions with Oniguruma. The
// split expressions of GPT-2, Llama 3 and Qwen2 are matched by
// hand-written scanners; other expressions run on Go's regexp when it can
// run them, and on github.com/dlclark/regexp2 when they need lookaround
// (Mistral-Nemo's \s+(?!\S)), backreferences, atomic groups or word
// boundaries. Either way they are first rewritten to mean what they mean
// in Oniguruma: Unicode \s, \d, \w and \b, ^ and $ at every line. Class
// intersection, nested classes and POSIX brackets are rejected, and (?i)
// folds one character to one character (Oniguruma also matches ß to ss).
//
// Tests compare the package with Hugging Face's library on the real
// tokenizer files of Llama 3, Qwen3, Llama 2 and Mistral-Nemo (see
// testdata/README.md).
//
// FromGGUF builds the same tokenizers from the vocabulary of a GGUF file
// (llama.cpp's tokenizer.ggml.* metadata: the "llama" SentencePiece kind,
// with scores or merges, and the "gpt2" byte-level kind with GPT-2's,
// Llama 3's or Qwen2's pre-tokenizer), and GGUFVocab writes a tokenizer
// of those forms as such a vocabulary.
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
