/**
 * The run's ranks, one line each, narrow enough for the side panel at its default width: rank and
 * state, step, steps/s, and bars for its GPU's utilisation and memory. A click on a line opens its
 * detail below it (device, pid, the state's reason, the whole progress line); another closes it.
 */

import { bar, el, headedTable } from './dom';
import { IRank, IRankFigures, IRun } from './protocol';

/**
 * The table of `run`'s ranks; ranks in `open` show their detail, and `toggle` is called with a
 * rank whose line was clicked (the view keeps `open` across redraws).
 */
export function rankTable(run: IRun, open: ReadonlySet<number>, toggle: (rank: number) => void): HTMLTableElement {
  const [table, body] = headedTable('accelnb-GpuPanel-ranks', ['Rank', 'Step', 'Steps/s', 'GPU']);
  for (const rank of run.ranks) {
    const isOpen = open.has(rank.rank);
    const row = body.insertRow();
    row.className = 'accelnb-GpuPanel-rankLine';
    row.dataset.rank = String(rank.rank);
    row.dataset.phase = rank.phase;
    row.tabIndex = 0;
    row.setAttribute('aria-expanded', String(isOpen));
    row.title = `Rank ${rank.rank}: ${rank.phase}. Click for its detail`;
    const onActivate = () => toggle(rank.rank);
    row.addEventListener('click', onActivate);
    row.addEventListener('keydown', event => {
      if (event.key === 'Enter' || event.key === ' ') {
        event.preventDefault();
        onActivate();
      }
    });
    const figures = rank.figures;
    const who = row.insertCell();
    who.className = 'accelnb-GpuPanel-rankCell';
    who.append(
      el('span', 'accelnb-GpuPanel-caret', isOpen ? '▾' : '▸'),
      el('span', `accelnb-GpuPanel-dot accelnb-mod-${rank.phase}`, '●'),
      String(rank.rank)
    );
    row.insertCell().textContent = figures ? figures.steps.toLocaleString('en-US') : '';
    row.insertCell().textContent = figures ? rate(figures.steps_per_s) : '';
    row.insertCell().appendChild(gpuBars(rank.rank, figures));
    if (isOpen) {
      body.appendChild(detailRow(rank));
    }
  }
  return table;
}

function rate(stepsPerS: number | null): string {
  if (stepsPerS === null) {
    return '–';
  }
  return stepsPerS >= 1 ? stepsPerS.toFixed(1) : stepsPerS.toFixed(2);
}

/** Its GPU's utilisation and memory, two thin bars one above the other; none for a CPU rank. */
function gpuBars(rank: number, figures: IRankFigures | undefined): HTMLElement {
  const bars = el('div', 'accelnb-GpuPanel-rankBars');
  const util = figures?.gpu_utilization ?? null;
  const used = figures?.gpu_memory_used ?? null;
  const total = figures?.gpu_memory_total ?? null;
  const memory = used !== null && total ? (100 * used) / total : null;
  if (util === null && memory === null) {
    return bars; // no GPU reading (yet): empty bars would read as an idle GPU
  }
  bars.append(
    bar('util', util, `rank ${rank}'s GPU utilisation: ${util === null ? '–' : `${util}%`}`),
    bar('mem', memory, `rank ${rank}'s GPU memory: ${memory === null ? '–' : `${memory.toFixed(0)}%`}`)
  );
  return bars;
}

/** What one line leaves out, on a full-width row under it. */
function detailRow(rank: IRank): HTMLTableRowElement {
  const row = document.createElement('tr');
  row.className = 'accelnb-GpuPanel-rankDetail';
  row.dataset.detailOf = String(rank.rank);
  const cell = row.insertCell();
  cell.colSpan = 4;
  const facts = [rank.device, rank.pid === null ? 'no pid yet' : `pid ${rank.pid}`, rank.phase];
  cell.appendChild(el('div', '', facts.join(' · ')));
  if (rank.detail) {
    cell.appendChild(el('div', `accelnb-mod-${rank.phase}`, rank.detail));
  }
  if (rank.progress) {
    cell.appendChild(el('div', 'accelnb-GpuPanel-progress', rank.progress));
  }
  return row;
}
