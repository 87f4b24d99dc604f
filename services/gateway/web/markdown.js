// A small Markdown renderer for model output: code fences, inline code, headings, bold, italic,
// strikethrough, lists, quotes, tables, rules and links. The text is HTML-escaped before any tag
// is made, so the only tags in the result are the ones made here; links keep only http(s) and
// mailto targets. An unclosed code fence runs to the end (the answer is still streaming).

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
export const escapeHtml = (s) => String(s).replace(/[&<>"']/g, (c) => ESCAPES[c]);

const SAFE_HREF = /^(https?:\/\/|mailto:)[^\s]+$/i;
const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)(\s+#+)?\s*$/;
const RULE = /^ {0,3}([-*_])( *\1){2,} *$/;
const QUOTE = /^ {0,3}> ?/;
const ITEM = /^( *)([-*+]|\d{1,9}[.)])( +|$)(.*)$/;
const TABLE_RULE = /^ {0,3}\|?( *:?-+:? *\|)+( *:?-+:? *)?\|? *$|^ {0,3}\|? *:?-+:? *\| *:?-+:?/;

export function renderMarkdown(src) {
  const text = String(src ?? "")
    .replace(/\r\n?/g, "\n")
    .replace(/\u0000/g, "\uFFFD"); // \u0000 marks held pieces in inline()
  return blocks(text.split("\n"));
}

function link(href, label) {
  return `<a href="${escapeHtml(href)}" target="_blank" rel="noopener noreferrer">${label}</a>`;
}

function emphasis(s) {
  return s
    .replace(/\*\*(?=\S)([\s\S]*?\S)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^\w])__(?=\S)([\s\S]*?\S)__(?!\w)/g, "$1<strong>$2</strong>")
    .replace(/(^|[^*\w])\*(?=[^\s*])([^*\n]*?[^\s*])\*(?![*\w])/g, "$1<em>$2</em>")
    .replace(/(^|[^\w])_(?=[^\s_])([^_\n]*?[^\s_])_(?!\w)/g, "$1<em>$2</em>")
    .replace(/~~(?=\S)([\s\S]*?\S)~~/g, "<del>$1</del>");
}

// Inline markup of raw text. Code spans, links and bare URLs are taken out first (held as
// \u0000N\u0000) so nothing else is parsed inside them; the rest is escaped, then emphasised.
function inline(raw) {
  const held = [];
  const hold = (html) => `\u0000${held.push(html) - 1}\u0000`;
  let s = raw.replace(/(`+)([\s\S]*?[^`])\1(?!`)/g, (_, _ticks, code) =>
    hold(`<code>${escapeHtml(code.replace(/^ ([\s\S]*) $/, "$1"))}</code>`),
  );
  s = s.replace(/\[([^\]\n]+)\]\( *<?([^)\s>]+)>? *\)/g, (all, label, href) =>
    SAFE_HREF.test(href) ? hold(link(href, emphasis(escapeHtml(label)))) : all,
  );
  s = s.replace(/\bhttps?:\/\/[^\s<>"'`\u0000]*[^\s<>"'`\u0000.,:;!?)\]]/g, (url) =>
    hold(link(url, escapeHtml(url))),
  );
  s = emphasis(escapeHtml(s));
  const restore = (t) => t.replace(/\u0000(\d+)\u0000/g, (_, i) => restore(held[Number(i)]));
  return restore(s);
}

function codeBlock(code, lang) {
  const label = lang ? `<span>${escapeHtml(lang)}</span>` : "<span>code</span>";
  return (
    `<div class="code"><div class="code-head">${label}` +
    `<button type="button" class="copy-code">Copy</button></div>` +
    `<pre><code>${escapeHtml(code)}</code></pre></div>`
  );
}

const indentOf = (line) => line.length - line.trimStart().length;

function isTable(lines, i) {
  return lines[i].includes("|") && i + 1 < lines.length && TABLE_RULE.test(lines[i + 1]);
}

function startsBlock(lines, i) {
  const l = lines[i];
  return (
    FENCE.test(l) ||
    HEADING.test(l) ||
    RULE.test(l) ||
    QUOTE.test(l) ||
    isItem(l) ||
    isTable(lines, i)
  );
}

function isItem(line) {
  const m = ITEM.exec(line);
  return m !== null && m[4].trim() !== "";
}

function cells(line) {
  return line
    .trim()
    .replace(/^\|/, "")
    .replace(/\|$/, "")
    .split("|")
    .map((c) => c.trim());
}

function table(lines, i, out) {
  const head = cells(lines[i]);
  const align = cells(lines[i + 1]).map((c) =>
    c.startsWith(":") && c.endsWith(":") ? "c" : c.endsWith(":") ? "r" : "",
  );
  const row = (cs, tag) =>
    "<tr>" +
    head
      .map((_, k) => {
        const cls = align[k] ? ` class="al-${align[k]}"` : "";
        return `<${tag}${cls}>${inline(cs[k] ?? "")}</${tag}>`;
      })
      .join("") +
    "</tr>";
  const body = [];
  i += 2;
  while (i < lines.length && lines[i].includes("|") && lines[i].trim())
    body.push(row(cells(lines[i++]), "td"));
  out.push(
    `<div class="table"><table><thead>${row(head, "th")}</thead>` +
      `<tbody>${body.join("")}</tbody></table></div>`,
  );
  return i;
}

function list(lines, i, out) {
  const first = ITEM.exec(lines[i]);
  const indent = first[1].length;
  const ordered = /\d/.test(first[2]);
  const items = [];
  while (i < lines.length) {
    const line = lines[i];
    const m = ITEM.exec(line);
    if (m && isItem(line) && m[1].length < indent + 2 && /\d/.test(m[2]) === ordered) {
      items.push({ lines: [m[4]], pad: m[1].length + m[2].length + Math.max(1, m[3].length) });
      i++;
    } else if (!line.trim()) {
      // A blank line ends the list unless an indented line or another item follows.
      const next = lines[i + 1];
      if (next === undefined || !next.trim() || (indentOf(next) <= indent && !isItem(next))) break;
      items.at(-1).lines.push("");
      i++;
    } else if (indentOf(line) > indent) {
      const item = items.at(-1);
      item.lines.push(line.slice(Math.min(indentOf(line), item.pad)));
      i++;
    } else if (!startsBlock(lines, i) && items.at(-1).lines.at(-1).trim()) {
      items.at(-1).lines.push(line.trim()); // a paragraph's lazy continuation
      i++;
    } else break;
  }
  const tag = ordered ? "ol" : "ul";
  const start = ordered ? parseInt(first[2], 10) : 1;
  const attr = start !== 1 ? ` start="${start}"` : "";
  // A tight item (no blank line in it) shows its first paragraph without <p>.
  const html = items.map((it) => {
    while (it.lines.at(-1) === "") it.lines.pop(); // the blank line before the next list
    const inner = blocks(it.lines);
    return `<li>${it.lines.includes("") ? inner : inner.replace(/^<p>([\s\S]*?)<\/p>/, "$1")}</li>`;
  });
  out.push(`<${tag}${attr}>${html.join("")}</${tag}>`);
  return i;
}

function blocks(lines) {
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if (!line.trim()) {
      i++;
    } else if ((m = FENCE.exec(line))) {
      const close = new RegExp(`^ {0,3}${m[1][0] === "`" ? "`" : "~"}{${m[1].length},}\\s*$`);
      const body = [];
      for (i++; i < lines.length && !close.test(lines[i]); i++) body.push(lines[i]);
      i++;
      out.push(codeBlock(body.join("\n"), m[2]));
    } else if ((m = HEADING.exec(line))) {
      // Headings in an answer sit below the page's own: # is <h3>.
      const level = Math.min(m[1].length + 2, 6);
      out.push(`<h${level}>${inline(m[2])}</h${level}>`);
      i++;
    } else if (RULE.test(line)) {
      out.push("<hr>");
      i++;
    } else if (QUOTE.test(line)) {
      const inner = [];
      while (i < lines.length && QUOTE.test(lines[i])) inner.push(lines[i++].replace(QUOTE, ""));
      out.push(`<blockquote>${blocks(inner)}</blockquote>`);
    } else if (isItem(line)) {
      i = list(lines, i, out);
    } else if (isTable(lines, i)) {
      i = table(lines, i, out);
    } else {
      const para = [line];
      for (i++; i < lines.length && lines[i].trim() && !startsBlock(lines, i); i++)
        para.push(lines[i]);
      out.push(`<p>${inline(para.join("\n")).replace(/\n/g, "<br>")}</p>`);
    }
  }
  return out.join("");
}
