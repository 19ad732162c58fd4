/**
 * The "GPUs" side panel: plain DOM, redrawn from the model on every change.
 *
 * Sections, top to bottom: which notebook it follows and whether accelnb is loaded there; a
 * banner when the inventory is synthetic; the GPU table (`gpuTable.ts`: one checkbox per GPU, its
 * bars and last minute; or a number of CPU ranks when there is no GPU); the selection as the
 * equivalent `%%distributed` line; the trials of a sweep (which trial each GPU runs, also tagged
 * on its GPU row); the run in progress (`rankTable.ts`: one line per rank, its detail a click
 * away) with a Stop button and a Stacks button; the last stacks read.
 *
 * While the panel is shown it has the kernel read the GPUs every 2 s, for their history.
 */

import { LabIcon } from '@jupyterlab/ui-components';
import { Message } from '@lumino/messaging';
import { Widget } from '@lumino/widgets';

import { el, headedTable } from './dom';
import { gpuTable } from './gpuTable';
import { GpuPanelModel } from './model';
import { IRun, ISelection, IStacksMessage, IStateMessage, ISweep, ITrial } from './protocol';
import { rankTable } from './rankTable';

const GPU_ICON_SVG =
  '<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 24 24">' +
  '<g class="jp-icon3" fill="#616161">' +
  '<path d="M9 2h2v2h2V2h2v2h2a2 2 0 0 1 2 2v2h2v2h-2v2h2v2h-2v2h2v2h-2v2a2 2 0 0 1-2 2h-2v2h-2v-2' +
  'h-2v2H9v-2H7a2 2 0 0 1-2-2v-2H3v-2h2v-2H3v-2h2V8H3V6h2a2 2 0 0 1 2-2h2V2zm-2 4v14h10V6H7zm2 3h6v6' +
  'H9V9z"/></g></svg>';

export const gpuIcon = new LabIcon({ name: 'accelnb:gpu', svgstr: GPU_ICON_SVG });

export class GpuPanelView extends Widget {
  constructor(model: GpuPanelModel) {
    super();
    this._model = model;
    this.addClass('accelnb-GpuPanel');
    // A redraw replaces every element, and a click whose press and release straddle one lands on
    // no button (the browser forgets a pressed element once it leaves the page): a running launch
    // redraws the panel every second, and a Stop once did nothing. So no redraw while a pointer is
    // pressed in the panel; the one that was due comes once the click is through.
    this.node.addEventListener('pointerdown', this._onPress);
    window.addEventListener('pointerup', this._onRelease, true);
    window.addEventListener('pointercancel', this._onRelease, true);
    model.changed.connect(this._render, this);
    this._render();
  }

  dispose(): void {
    this._model.changed.disconnect(this._render, this);
    window.removeEventListener('pointerup', this._onRelease, true);
    window.removeEventListener('pointercancel', this._onRelease, true);
    super.dispose();
  }

  protected onAfterShow(msg: Message): void {
    super.onAfterShow(msg);
    this._model.watch(true);
  }

  protected onAfterHide(msg: Message): void {
    super.onAfterHide(msg);
    this._model.watch(false);
  }

  private _onPress = (): void => {
    this._pressed = true;
  };

  private _onRelease = (): void => {
    if (!this._pressed) {
      return;
    }
    this._pressed = false;
    if (this._redrawDue) {
      this._redrawDue = false;
      window.setTimeout(() => this._render(), 0); // after the click this release makes
    }
  };

  private _render(): void {
    if (this._pressed) {
      this._redrawDue = true;
      return;
    }
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
      const trials = trialsByGpu(state.sweep ?? null);
      root.appendChild(gpuTable(inventory.gpus, selection, trials, gpus => this._model.select(gpus)));
    }
    const refresh = el('button', 'jp-Button jp-mod-styled jp-mod-reject accelnb-GpuPanel-refresh', 'Refresh');
    refresh.title = 'Read memory and utilisation again';
    refresh.addEventListener('click', () => this._model.refresh());
    root.appendChild(refresh);
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
      const config = row.insertCell();
      config.className = 'accelnb-GpuPanel-config';
      config.textContent = trial.label;
      config.title = trial.label; // the column is cut to the panel's width
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
    if (run.run_id !== this._openRunId) {
      this._openRanks.clear(); // a new run: its ranks start closed
      this._openRunId = run.run_id;
    }
    const table = rankTable(run, this._openRanks, rank => {
      if (!this._openRanks.delete(rank)) {
        this._openRanks.add(rank);
      }
      this._render();
    });
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
  private _pressed = false; // a pointer is down in the panel
  private _redrawDue = false; // a change came meanwhile
  private _openRanks = new Set<number>(); // ranks whose detail the user opened
  private _openRunId: number | null = null;
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
