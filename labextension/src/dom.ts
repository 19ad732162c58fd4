/**
 * Small DOM builders shared by the panel's sections: elements, tables, bars and a sparkline.
 * Colours come from the CSS (`style/base.css`), which uses JupyterLab's theme variables only.
 */

const SVG_NS = 'http://www.w3.org/2000/svg';
const GIB = 2 ** 30;

/** An element of this tag and class, with this text. */
export function el(tag: string, className: string, text?: string): HTMLElement {
  const node = document.createElement(tag);
  if (className) {
    node.className = className;
  }
  if (text !== undefined) {
    node.textContent = text;
  }
  return node;
}

/** A table of this class with one header row of these titles, and its (empty) body. */
export function headedTable(className: string, titles: string[]): [HTMLTableElement, HTMLTableSectionElement] {
  const table = el('table', className) as HTMLTableElement;
  const head = table.createTHead().insertRow();
  for (const title of titles) {
    head.appendChild(el('th', '', title));
  }
  return [table, table.createTBody()];
}

/** "3.0 GiB": bytes as GiB, one decimal. */
export function gib(bytes: number): string {
  return `${(bytes / GIB).toFixed(1)} GiB`;
}

/**
 * A horizontal bar filled to `percent` (null: no figure, an empty track), of this kind
 * (`util` or `mem`, which the CSS colours), with `label` as its accessible name and tooltip.
 */
export function bar(kind: 'util' | 'mem', percent: number | null, label: string): HTMLElement {
  const track = el('div', `accelnb-Bar accelnb-Bar-${kind}`);
  track.setAttribute('role', 'meter');
  track.setAttribute('aria-label', label);
  track.title = label;
  if (percent !== null) {
    const clamped = Math.max(0, Math.min(100, percent));
    track.setAttribute('aria-valuenow', String(Math.round(clamped)));
    const fill = el('div', 'accelnb-Bar-fill');
    fill.style.width = `${clamped}%`;
    track.appendChild(fill);
  }
  return track;
}

/**
 * The last `spanS` seconds of a percentage as an SVG sparkline (an area under a line), newest at
 * the right. `points` are [seconds ago, percent], oldest first.
 */
export function sparkline(points: [number, number][], spanS: number, label: string): SVGSVGElement {
  const svg = document.createElementNS(SVG_NS, 'svg');
  svg.setAttribute('class', 'accelnb-Sparkline');
  svg.setAttribute('viewBox', `0 0 ${spanS} 100`);
  svg.setAttribute('preserveAspectRatio', 'none');
  svg.setAttribute('role', 'img');
  svg.setAttribute('aria-label', label);
  svg.dataset.points = String(points.length);
  const title = document.createElementNS(SVG_NS, 'title');
  title.textContent = label;
  svg.appendChild(title);
  if (points.length < 2) {
    return svg; // an empty track: one reading is no history yet (it drew as a stray dot)
  }
  const line = points.map(([ago, percent]) => `${(spanS - ago).toFixed(1)},${(100 - percent).toFixed(1)}`);
  const first = line[0].split(',')[0];
  const last = line[line.length - 1].split(',')[0];
  const area = document.createElementNS(SVG_NS, 'polygon');
  area.setAttribute('class', 'accelnb-Sparkline-area');
  area.setAttribute('points', `${first},100 ${line.join(' ')} ${last},100`);
  const stroke = document.createElementNS(SVG_NS, 'polyline');
  stroke.setAttribute('class', 'accelnb-Sparkline-line');
  stroke.setAttribute('points', line.join(' '));
  stroke.setAttribute('vector-effect', 'non-scaling-stroke');
  svg.append(area, stroke);
  return svg;
}
