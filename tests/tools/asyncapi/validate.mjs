// Validates an AsyncAPI document with the real parser (tests/unit/test_asyncapi.py):
// prints each diagnostic as a JSON line; exits 1 when the document does not parse.
import { Parser } from '@asyncapi/parser';
import { readFileSync } from 'node:fs';

const parser = new Parser();
const text = readFileSync(process.argv[2], 'utf8');
const { document, diagnostics } = await parser.parse(text);
for (const d of diagnostics) {
  console.log(JSON.stringify({ severity: d.severity, code: d.code, message: d.message, path: d.path }));
}
process.exit(document ? 0 : 1);
