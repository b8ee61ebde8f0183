// trainbpe.js writes ../trainbpe_cases.json.gz, which TestTrainBPEParity
// reads: Hugging Face tokenizers' encodings, with special tokens, of texts
// under the tokenizer.json that TrainBPE writes for the test.
//
// Run: D=$(mktemp -d) && STRATA_TRAINBPE_DUMP=$D go test ./loader/tokenizer
// -run TestTrainBPEParity && (cd loader/tokenizer/testdata/gen && npm ci &&
// node trainbpe.js $D)
"use strict";

const crypto = require("crypto");
const fs = require("fs");
const path = require("path");
const zlib = require("zlib");
const { Tokenizer } = require("tokenizers");

async function main() {
  const dir = process.argv[2];
  const file = path.join(dir, "tokenizer.json");
  const tok = Tokenizer.fromFile(file);
  const texts = JSON.parse(fs.readFileSync(path.join(dir, "texts.json"), "utf8"));
  const cases = [];
  for (const text of texts) {
    const e = await tok.encode(text, null, { addSpecialTokens: true });
    cases.push({ text, ids: e.getIds() });
  }
  const out = {
    how: "examples of TrainBPE's tokenizer, encoded by Hugging Face tokenizers (npm binding " +
      require("tokenizers/package.json").version + ") with addSpecialTokens, by gen/trainbpe.js",
    tokenizer_sha256: crypto.createHash("sha256").update(fs.readFileSync(file)).digest("hex"),
    cases,
  };
  fs.writeFileSync(path.resolve(__dirname, "..", "trainbpe_cases.json.gz"), zlib.gzipSync(JSON.stringify(out)));
}
main();
