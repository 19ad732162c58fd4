/**
 * The panel's GPU table: one row per GPU with its checkbox, memory and utilisation as bars with
 * their numbers, the last minute of utilisation, the processes holding it, and a mark on a
 * selected GPU that another process holds (seen before the launch, not after it fails).
 */

import { bar, el, gib, headedTable, sparkline } from './dom';
import { IGpu, IGpuProcess, ISelection, ITrial } from './protocol';

/** The span of the utilisation history the kernel keeps (`gpu_watch.HISTORY_S`). */
const HISTORY_S = 60;

/**
 * The table of `gpus`, ticked as `selection` says; `onChange` gets every ticked GPU after a click.
 * `trials`: the sweep trial each GPU runs now, if any.
 */
export function gpuTable(
  gpus: IGpu[],
  selection: ISelection,
  trials: Map<number, ITrial>,
  onChange: (gpus: number[]) => void
): HTMLTableElement {
  const chosen = new Set(selection.gpus ?? []);
  const [table, body] = headedTable('accelnb-GpuPanel-gpus', ['', '#', 'GPU']);
  for (const gpu of gpus) {
    const row = body.insertRow();
    row.dataset.gpu = String(gpu.index);
    const box = document.createElement('input');
    box.type = 'checkbox';
    box.checked = chosen.has(gpu.index);
    box.disabled = !gpu.visible;
    box.setAttribute('aria-label', `GPU ${gpu.index}`);
    box.title = gpu.visible ? `Use GPU ${gpu.index}` : 'Hidden from this kernel by its CUDA_VISIBLE_DEVICES';
    // Read every box, not the state this table was drawn from: a second click may come
    // before the kernel's answer to the first redraws the table.
    box.addEventListener('change', () => onChange(checkedGpus(table)));
    row.insertCell().appendChild(box);
    row.insertCell().textContent = String(gpu.index);
    row.insertCell().appendChild(gpuAbout(gpu, trials.get(gpu.index)));
    if (!gpu.visible) {
      row.classList.add('accelnb-mod-hidden');
    }
    if (gpu.busy) {
      row.classList.add('accelnb-mod-busy');
    }
  }
  return table;
}

/** Everything about one GPU, in a column narrow enough for the side panel. */
function gpuAbout(gpu: IGpu, trial: ITrial | undefined): HTMLElement {
  const about = el('div', 'accelnb-GpuPanel-about');
  const name = el('div', 'accelnb-GpuPanel-name', gpu.name);
  name.title = `${gpu.uuid} (bus ${gpu.pci_bus_id})`;
  about.appendChild(name);
  if (trial) {
    const tag = el('div', 'accelnb-GpuPanel-trial', `trial ${trial.index}: ${trial.label}`);
    tag.title = `The sweep trial this GPU runs: trial ${trial.index}, ${trial.label}`;
    about.appendChild(tag);
  }
  if (gpu.busy) {
    const busy = el('div', 'accelnb-GpuPanel-busy', `⚠ ${gpu.busy}`);
    busy.title = 'Selected for the next launch, yet another process holds this GPU';
    about.appendChild(busy);
  }
  about.appendChild(figures(gpu));
  if (gpu.processes.length > 0) {
    const list = el('ul', 'accelnb-GpuPanel-processes');
    for (const process of gpu.processes) {
      list.appendChild(processItem(process));
    }
    about.appendChild(list);
  }
  return about;
}

/** Memory and utilisation as labelled bars with their numbers, then the last minute. */
function figures(gpu: IGpu): HTMLElement {
  const grid = el('div', 'accelnb-GpuPanel-figures');
  const memoryText = `${(gpu.memory_used / 2 ** 30).toFixed(1)} / ${(gpu.memory_total / 2 ** 30).toFixed(0)} GiB`;
  const memoryShare = gpu.memory_total > 0 ? (100 * gpu.memory_used) / gpu.memory_total : null;
  grid.append(
    el('span', 'accelnb-GpuPanel-figureName', 'mem'),
    bar('mem', memoryShare, `GPU ${gpu.index} memory: ${memoryText}`),
    el('span', 'accelnb-GpuPanel-memory', memoryText)
  );
  const utilText = gpu.utilization === null ? '–' : `${gpu.utilization}%`;
  grid.append(
    el('span', 'accelnb-GpuPanel-figureName', 'util'),
    bar('util', gpu.utilization, `GPU ${gpu.index} utilisation: ${utilText}`),
    el('span', 'accelnb-GpuPanel-util', utilText)
  );
  if (gpu.history !== undefined) {
    const history = sparkline(gpu.history, HISTORY_S, `GPU ${gpu.index} utilisation, the last minute`);
    grid.append(el('span', 'accelnb-GpuPanel-figureName', '1 min'), history);
  }
  return grid;
}

function processItem(process: IGpuProcess): HTMLElement {
  const parts = [process.name || 'process not visible here', `pid ${process.pid}`];
  if (process.memory_used !== null) {
    parts.push(gib(process.memory_used));
  }
  if (process.ours) {
    parts.push('this kernel');
  } else if (process.user) {
    parts.push(process.user);
  }
  const item = el('li', process.ours ? 'accelnb-mod-ours' : 'accelnb-mod-other', parts.join(' · '));
  item.dataset.pid = String(process.pid);
  return item;
}

function checkedGpus(table: HTMLTableElement): number[] {
  const rows = table.querySelectorAll<HTMLTableRowElement>('tbody tr[data-gpu]');
  return Array.from(rows)
    .filter(row => row.querySelector<HTMLInputElement>('input[type="checkbox"]')?.checked)
    .map(row => Number(row.dataset.gpu));
}
