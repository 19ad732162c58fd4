/**
 * The "GPUs" side panel: plain DOM, redrawn from the model on every change.
 *
 * Sections, top to bottom: which notebook it follows and whether accelnb is loaded there; a
 * banner when the inventory is synthetic; the GPU table with one checkbox per GPU (or a number
 * of CPU ranks when there is no GPU); the selection as the equivalent `%%distributed` line; the
 * trials of a sweep (which trial each GPU runs, also tagged on its GPU row); the run in progress,
 * one row per rank, with a Stop button and a Stacks button; the last stacks read.
 */

import { LabIcon } from '@jupyterlab/ui-components';
import { Widget } from '@lumino/widgets';

import { GpuPanelModel } from './model';
import { IGpu, IRun, ISelection, IStacksMessage, IStateMessage, ISweep, ITrial } from './protocol';

const GPU_ICON_SVG =
  '<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 24 24">' +
  '<g class="jp-icon3" fill="#616161">' +
  '<path d="M9 2h2v2h2V2h2v2h2a2 2 0 0 1 2 2v2h2v2h-2v2h2v2h-2v2h2v2h-2v2a2 2 0 0 1-2 2h-2v2h-2v-2' +
  'h-2v2H9v-2H7a2 2 0 0 1-2-2v-2H3v-2h2v-2H3v-2h2V8H3V6h2a2 2 0 0 1 2-2h2V2zm-2 4v14h10V6H7zm2 3h6v6' +
  'H9V9z"/></g></svg>';

export const gpuIcon = new LabIcon({ name: 'accelnb:gpu', svgstr: GPU_ICON_SVG });

const GIB = 2 ** 30;

export class GpuPanelView extends Widget {
  constructor(model: GpuPanelModel) {
    super();
    this._model = model;
    this.addClass('accelnb-GpuPanel');
    model.changed.connect(this._render, this);
    this._render();
  }

  dispose(): void {
    this._model.changed.disconnect(this._render, this);
    super.dispose();
  }

  private _render(): void {
    const model = this._model;
    const root = this.node;
    root.textContent = '';
    root.appendChild(el('h2', 'accelnb-GpuPanel-title', 'GPUs'));
    const status = el('div', 'accelnb-GpuPanel-status');
    status.dataset.connection = model.connection;
    root.appendChild(status);

    switch (model.connection) {
      case 'no-notebook':
        status.textContent = 'Open a notebook to choose its GPUs.';
        return;
      case 'no-kernel':
        status.textContent = `${model.notebookName}: no kernel is running.`;
        return;
      case 'checking':
        status.textContent = `${model.notebookName}: asking the kernel…`;
        break;
      case 'not-loaded':
        status.append(`${model.notebookName}: run `, el('code', '', '%load_ext accelnb'), ' in the notebook.');
        return;
      case 'connected':
        status.textContent = `Notebook: ${model.notebookName}`;
        break;
    }
    const state = model.state;
    if (!state) {
      return;
    }
    if (model.error) {
      root.appendChild(el('div', 'accelnb-GpuPanel-error', model.error));
    }
    this._renderInventory(root, state);
    this._renderSelection(root, state.selection);
    this._renderSweep(root, state.sweep ?? null);
    this._renderRun(root, state.run);
  }

  private _renderInventory(root: HTMLElement, state: IStateMessage): void {
    const { inventory, selection } = state;
    if (inventory.synthetic) {
      root.appendChild(
        el('div', 'accelnb-GpuPanel-synthetic', 'Synthetic inventory (no real GPUs): launches run CPU ranks.')
      );
    }
    if (inventory.gpus.length === 0) {
      const why = inventory.note ? ` (${inventory.note})` : '';
      root.appendChild(el('div', 'accelnb-GpuPanel-noGpu', `No GPU found${why}: launches use CPU ranks.`));
      const label = el('label', 'accelnb-GpuPanel-procs', 'CPU ranks ');
      const input = document.createElement('input');
      input.type = 'number';
      input.min = '1';
      input.step = '1';
      input.value = String(selection.num_processes ?? '');
      input.placeholder = '2';
      // 'change' fires on Enter or when leaving the field, not on every keystroke.
      input.addEventListener('change', () => {
        const count = Number.parseInt(input.value, 10);
        if (Number.isInteger(count) && count >= 1) {
          this._model.selectProcesses(count);
        }
      });
      label.appendChild(input);
      root.appendChild(label);
    } else {
      root.appendChild(this._gpuTable(inventory.gpus, selection, trialsByGpu(state.sweep ?? null)));
    }
    const refresh = el('button', 'jp-Button jp-mod-styled jp-mod-reject accelnb-GpuPanel-refresh', 'Refresh');
    refresh.title = 'Read memory and utilisation again';
    refresh.addEventListener('click', () => this._model.refresh());
    root.appendChild(refresh);
  }

  private _gpuTable(gpus: IGpu[], selection: ISelection, trials: Map<number, ITrial>): HTMLTableElement {
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
      box.title = gpu.visible ? `Use GPU ${gpu.index}` : "Hidden from this kernel by its CUDA_VISIBLE_DEVICES";
      // Read every box, not the state this table was drawn from: a second click may come
      // before the kernel's answer to the first redraws the table.
      box.addEventListener('change', () => this._model.select(checkedGpus(table)));
      row.insertCell().appendChild(box);
      row.insertCell().textContent = String(gpu.index);
      // A side panel is narrow: the name on one line, the figures on a second one.
      const about = row.insertCell();
      about.appendChild(el('div', 'accelnb-GpuPanel-name', gpu.name));
      const trial = trials.get(gpu.index);
      if (trial) {
        const tag = el('div', 'accelnb-GpuPanel-trial', `trial ${trial.index}: ${trial.label}`);
        tag.title = 'The sweep trial this GPU runs';
        about.appendChild(tag);
      }
      const figures = el('div', 'accelnb-GpuPanel-figures');
      const memory = `${(gpu.memory_used / GIB).toFixed(1)} / ${(gpu.memory_total / GIB).toFixed(0)} GiB`;
      figures.appendChild(el('span', 'accelnb-GpuPanel-memory', memory));
      const utilization = gpu.utilization === null ? 'util –' : `util ${gpu.utilization}%`;
      figures.appendChild(el('span', 'accelnb-GpuPanel-util', utilization));
      // Synthetic UUIDs share their first groups, so show both ends; the full one is the tooltip.
      const shortUuid = gpu.uuid.length > 16 ? `${gpu.uuid.slice(0, 8)}…${gpu.uuid.slice(-4)}` : gpu.uuid;
      const uuid = el('span', 'accelnb-GpuPanel-uuid', shortUuid);
      uuid.title = `${gpu.uuid} (bus ${gpu.pci_bus_id})`;
      figures.appendChild(uuid);
      about.appendChild(figures);
      if (!gpu.visible) {
        row.classList.add('accelnb-mod-hidden');
      }
    }
    return table;
  }

  private _renderSelection(root: HTMLElement, selection: ISelection): void {
    const section = el('div', 'accelnb-GpuPanel-selection');
    if (selection.gpus === null && selection.num_processes === null) {
      section.append('No selection: a launch uses every visible GPU. Same as ');
    } else {
      section.append('Next launch, same as ');
    }
    section.appendChild(el('code', 'accelnb-GpuPanel-magic', selection.magic_line));
    root.appendChild(section);
  }

  /** A sweep's trials: which runs on which GPUs, which wait, how the others ended. */
  private _renderSweep(root: HTMLElement, sweep: ISweep | null): void {
    if (!sweep) {
      return;
    }
    const section = el('div', 'accelnb-GpuPanel-sweep');
    const running = sweep.trials.filter(t => t.state === 'running').length;
    const queued = sweep.trials.filter(t => t.state === 'queued').length;
    const title = sweep.finished
      ? `Last sweep: ${sweep.trials.length} trials`
      : `Sweep: ${running} running, ${queued} queued`;
    section.appendChild(el('div', 'accelnb-GpuPanel-runTitle', title));
    const [table, body] = headedTable('accelnb-GpuPanel-trials', ['Trial', 'GPUs', 'State', 'Config']);
    for (const trial of sweep.trials) {
      const row = body.insertRow();
      row.dataset.trial = String(trial.index);
      row.dataset.state = trial.state;
      row.insertCell().textContent = String(trial.index);
      row.insertCell().textContent = trial.gpus.length ? trial.gpus.join(',') : trial.state === 'queued' ? '' : 'cpu';
      const state = row.insertCell();
      state.className = `accelnb-GpuPanel-phase accelnb-mod-${trial.state}`;
      state.textContent = trial.state;
      row.insertCell().textContent = trial.label;
    }
    section.appendChild(table);
    root.appendChild(section);
  }

  private _renderRun(root: HTMLElement, run: IRun | null): void {
    const section = el('div', 'accelnb-GpuPanel-run');
    root.appendChild(section);
    if (!run) {
      section.appendChild(el('div', 'accelnb-GpuPanel-runTitle', 'No run yet.'));
      return;
    }
    const saving = run.finished ? null : run.stop_pending ?? null;
    const title = run.finished
      ? 'Last run: finished'
      : saving
        ? `Run in progress: stop requested (${saving}), ranks are saving`
        : 'Run in progress';
    section.appendChild(el('div', 'accelnb-GpuPanel-runTitle', title));
    const [table, body] = headedTable('accelnb-GpuPanel-ranks', ['Rank', 'Device', 'State', 'PID', 'Progress']);
    for (const rank of run.ranks) {
      const row = body.insertRow();
      row.dataset.rank = String(rank.rank);
      row.dataset.phase = rank.phase;
      row.insertCell().textContent = String(rank.rank);
      row.insertCell().textContent = rank.device;
      const phase = row.insertCell();
      phase.className = `accelnb-GpuPanel-phase accelnb-mod-${rank.phase}`;
      phase.textContent = rank.phase;
      if (rank.detail) {
        phase.title = rank.detail;
      }
      row.insertCell().textContent = rank.pid === null ? '' : String(rank.pid);
      const progress = row.insertCell();
      progress.className = 'accelnb-GpuPanel-progress';
      progress.textContent = rank.progress ?? '';
    }
    section.appendChild(table);
    if (!run.finished) {
      const stop = el('button', 'jp-Button jp-mod-styled jp-mod-warn accelnb-GpuPanel-stop', saving ? 'Stop now' : 'Stop');
      stop.title = saving
        ? `Stop requested (${saving}): the ranks are saving. Press to stop them now`
        : 'Interrupt the kernel: accelnb stops every worker of this run (code that checks ' +
          'accelnb.stop_requested() is asked to save and stop first)';
      stop.addEventListener('click', () => void this._model.stop());
      const stacks = el('button', 'jp-Button jp-mod-styled jp-mod-reject accelnb-GpuPanel-stacksButton',
        this._model.stacksPending ? 'Reading stacks…' : 'Stacks');
      stacks.title = "Show every rank's current Python stack; nothing stops";
      (stacks as HTMLButtonElement).disabled = this._model.stacksPending;
      stacks.addEventListener('click', () => this._model.requestStacks());
      const buttons = el('div', 'accelnb-GpuPanel-runButtons');
      buttons.append(stop, stacks);
      section.appendChild(buttons);
    }
    if (this._model.stacks) {
      section.appendChild(stacksView(this._model.stacks));
    }
  }

  private _model: GpuPanelModel;
}

function stacksView(stacks: IStacksMessage): HTMLElement {
  const view = el('div', 'accelnb-GpuPanel-stacks');
  view.appendChild(el('div', 'accelnb-GpuPanel-stacksTitle', `Stacks at ${stacks.taken_at} (nothing was stopped)`));
  if (stacks.error) {
    view.appendChild(el('div', 'accelnb-GpuPanel-error', stacks.error));
  }
  for (const { rank, stack } of stacks.ranks) {
    const block = el('div', 'accelnb-GpuPanel-rankStack');
    block.dataset.rank = String(rank);
    block.appendChild(el('div', 'accelnb-GpuPanel-rankStackTitle', `rank ${rank}`));
    block.appendChild(el('pre', '', stack));
    view.appendChild(block);
  }
  return view;
}

function checkedGpus(table: HTMLTableElement): number[] {
  const rows = table.querySelectorAll<HTMLTableRowElement>('tbody tr[data-gpu]');
  return Array.from(rows)
    .filter(row => row.querySelector<HTMLInputElement>('input[type="checkbox"]')?.checked)
    .map(row => Number(row.dataset.gpu));
}

function el(tag: string, className: string, text?: string): HTMLElement {
  const node = document.createElement(tag);
  if (className) {
    node.className = className;
  }
  if (text !== undefined) {
    node.textContent = text;
  }
  return node;
}

/** GPU → the sweep trial running on it now. */
function trialsByGpu(sweep: ISweep | null): Map<number, ITrial> {
  const byGpu = new Map<number, ITrial>();
  for (const trial of sweep && !sweep.finished ? sweep.trials : []) {
    if (trial.state === 'running') {
      for (const gpu of trial.gpus) {
        byGpu.set(gpu, trial);
      }
    }
  }
  return byGpu;
}

/** A table of this class with one header row of these titles, and its (empty) body. */
function headedTable(className: string, titles: string[]): [HTMLTableElement, HTMLTableSectionElement] {
  const table = el('table', className) as HTMLTableElement;
  const head = table.createTHead().insertRow();
  for (const title of titles) {
    head.appendChild(el('th', '', title));
  }
  return [table, table.createTBody()];
}
