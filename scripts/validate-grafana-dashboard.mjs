#!/usr/bin/env node
// Validates Grafana dashboards against Grafana's published schema, offline and strictly.
//
//     node scripts/validate-grafana-dashboard.mjs config/grafana/timeoutd.json
//
// Needs .tools/grafana from scripts/install-grafana-validator.sh: @grafana/schema (the
// dashboard model Grafana generates from its CUE schemas, as TypeScript types) and the
// TypeScript compiler. Each dashboard becomes a TypeScript module in which
// - the whole JSON `satisfies Dashboard` (every panel, variable, annotation, field config);
// - each panel's `options` and `fieldConfig.defaults.custom` satisfy the panel plugin's own
//   `Options` and `FieldConfig` types (timeseries, heatmap, stat, state-timeline); a panel
//   type with no schema here is an error;
// - each query satisfies the Prometheus query model (DataQuery from @grafana/schema plus the
//   fields of Grafana's Prometheus dataquery schema, which @grafana/schema does not ship).
// Object literals get TypeScript's excess-property check, so an unknown or misspelled field
// is an error, as is a wrong type or a value outside an enumeration. Exit status 1 and one
// line per problem, `file: where: message`; else `ok: ...`.

import { createRequire } from 'node:module';
import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..');
const tools = path.join(root, '.tools', 'grafana');
const require = createRequire(path.join(tools, 'package.json'));
let ts;
try {
  ts = require('typescript');
} catch (e) {
  console.error(`cannot load TypeScript from ${tools}: run scripts/install-grafana-validator.sh (${e.message})`);
  process.exit(2);
}
const schemaVersion = require('@grafana/schema/package.json').version;

const cfg = (dir, name) => `@grafana/schema/dist/esm/raw/composable/${dir}/panelcfg/x/${name}PanelCfg_types.gen`;
const PANELS = {
  timeseries: { module: cfg('timeseries', 'TimeSeries'), custom: true },
  heatmap: { module: cfg('heatmap', 'Heatmap'), custom: true },
  stat: { module: cfg('stat', 'Stat'), custom: false },
  'state-timeline': { module: cfg('statetimeline', 'StateTimeline'), custom: true },
};

// JSON spells an enumeration by its value; @grafana/schema declares many as TypeScript enums,
// to which a string literal is not assignable. Json<T> is T with each enum replaced by the
// union of its values (the template literal type of a string enum), everything else kept.
const JSON_TYPE = `
type Json<T> = T extends string
  ? \`\${T}\`
  : T extends readonly (infer U)[]
    ? Json<U>[]
    : T extends object
      ? { [K in keyof T]: Json<T[K]> }
      : T;
`;

const PROMETHEUS_QUERY = `
interface PrometheusQuery extends DataQuery {
  expr: string;
  legendFormat?: string;
  range?: boolean;
  instant?: boolean;
  exemplar?: boolean;
  format?: 'time_series' | 'table' | 'heatmap';
  interval?: string;
  intervalFactor?: number;
  editorMode?: 'code' | 'builder';
}
`;

function moduleFor(file, dashboard) {
  const lines = [];
  const where = []; // [first line, description]
  const add = (description, text) => {
    where.push([lines.length + 1, description]);
    lines.push(...text.split('\n'));
  };
  lines.push("import type { Dashboard, DataQuery } from '@grafana/schema';");
  Object.entries(PANELS).forEach(([type, p], i) => {
    lines.push(`import type * as P${i} from '${p.module}';`);
  });
  lines.push(...JSON_TYPE.split('\n'), ...PROMETHEUS_QUERY.split('\n'));
  add('dashboard', `export const dashboard = ${JSON.stringify(dashboard, null, 2)} satisfies Json<Dashboard>;`);
  const panels = (dashboard.panels ?? []).flatMap((p) => [p, ...(p.type === 'row' ? p.panels ?? [] : [])]);
  let queries = 0;
  panels.forEach((panel, n) => {
    const name = `panel ${JSON.stringify(panel.title ?? n)}`;
    if (panel.type === 'row') return;
    const index = Object.keys(PANELS).indexOf(panel.type);
    if (index < 0) {
      add(name, `export const unknown_${n}: never = ${JSON.stringify(`no schema for panel type ${panel.type}`)};`);
      return;
    }
    add(`${name} options`, `export const options_${n} = ${JSON.stringify(panel.options ?? {}, null, 2)} satisfies Json<P${index}.Options>;`);
    const custom = panel.fieldConfig?.defaults?.custom;
    if (custom !== undefined) {
      const type = PANELS[panel.type].custom ? `Json<P${index}.FieldConfig>` : 'Record<string, never>';
      add(`${name} fieldConfig.defaults.custom`, `export const custom_${n} = ${JSON.stringify(custom, null, 2)} satisfies ${type};`);
    }
    (panel.targets ?? []).forEach((target, t) => {
      queries += 1;
      add(`${name} target ${target.refId ?? t}`, `export const target_${n}_${t} = ${JSON.stringify(target, null, 2)} satisfies Json<PrometheusQuery>;`);
    });
  });
  for (const v of dashboard.templating?.list ?? []) {
    if (v.type === 'query') {
      queries += 1;
    }
  }
  return { source: lines.join('\n') + '\n', where, panels: panels.length, queries };
}

function check(file) {
  let dashboard;
  try {
    dashboard = JSON.parse(fs.readFileSync(file, 'utf8'));
  } catch (e) {
    return { problems: [`${file}: ${e.message}`] };
  }
  const { source, where, panels, queries } = moduleFor(file, dashboard);
  const dir = fs.mkdtempSync(path.join(tools, 'check-'));
  const generated = path.join(dir, 'dashboard.ts');
  fs.writeFileSync(generated, source);
  const program = ts.createProgram([generated], {
    strict: true,
    noEmit: true,
    target: ts.ScriptTarget.ES2022,
    module: ts.ModuleKind.ESNext,
    moduleResolution: ts.ModuleResolutionKind.Bundler,
    skipLibCheck: true,
    types: [],
  });
  const problems = ts.getPreEmitDiagnostics(program).map((d) => {
    const message = ts.flattenDiagnosticMessageText(d.messageText, ' ');
    if (!d.file || d.file.fileName !== generated.split(path.sep).join('/')) {
      return `${file}: ${message}`;
    }
    const line = d.file.getLineAndCharacterOfPosition(d.start ?? 0).line + 1;
    const at = where.filter(([first]) => first <= line).pop();
    // The node TypeScript points at: the offending key of the JSON, most often.
    const node = d.file.text.slice(d.start ?? 0, (d.start ?? 0) + Math.min(d.length ?? 0, 60));
    return `${file}: ${at ? at[1] : 'imports'}: at ${node}: ${message}`;
  });
  fs.rmSync(dir, { recursive: true, force: true });
  return { problems, panels, queries };
}

const files = process.argv.slice(2);
if (files.length === 0) {
  console.error('usage: validate-grafana-dashboard.mjs DASHBOARD.json...');
  process.exit(2);
}
let failed = false;
for (const file of files) {
  const { problems, panels, queries } = check(file);
  if (problems.length > 0) {
    failed = true;
    problems.forEach((p) => console.log(p));
  } else {
    console.log(`ok: ${file}: ${panels} panels, ${queries} queries, @grafana/schema ${schemaVersion}, strict`);
  }
}
process.exit(failed ? 1 : 0);
