/**
 * The notebook toolbar item: what the next `%%distributed` cell of this notebook will use.
 *
 * One per notebook, each with its own model (its own comm to that notebook's kernel), because
 * the side panel follows only the active notebook. It stays hidden until accelnb is loaded in
 * the kernel; then it reads "GPUs 1,3", "3 CPU ranks" or "all GPUs", marks a run in progress
 * and a chosen GPU that another process holds, and opens the side panel when clicked.
 */

import { ISessionContext } from '@jupyterlab/apputils';
import { Widget } from '@lumino/widgets';

import { GpuPanelModel } from './model';
import { IStateMessage } from './protocol';
import { gpuIcon } from './view';

/** The label for what the next launch will use, from the kernel's state. */
export function selectionLabel(state: IStateMessage): string {
  const { gpus, num_processes: processes } = state.selection;
  if (gpus && gpus.length > 0) {
    return `${gpus.length === 1 ? 'GPU' : 'GPUs'} ${gpus.join(',')}`;
  }
  if (processes) {
    return `${processes} CPU ${processes === 1 ? 'rank' : 'ranks'}`;
  }
  const usable = state.inventory.gpus.filter(gpu => gpu.visible).length;
  return usable > 0 ? `all ${usable} GPUs` : 'no GPU: choose CPU ranks';
}

export class GpuToolbarItem extends Widget {
  constructor(session: ISessionContext, openPanel: () => void) {
    super({ node: document.createElement('button') });
    this.addClass('accelnb-GpuToolbarItem');
    this.addClass('jp-ToolbarButtonComponent');
    const button = this.node as HTMLButtonElement;
    button.type = 'button';
    button.addEventListener('click', openPanel);
    this._icon.className = 'accelnb-GpuToolbarItem-icon';
    gpuIcon.element({ container: this._icon });
    this._label.className = 'accelnb-GpuToolbarItem-label';
    button.append(this._icon, this._label);

    this._model = new GpuPanelModel();
    this._model.changed.connect(this._render, this);
    this._model.setSession(session);
    this._render();
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this._model.changed.disconnect(this._render, this);
    this._model.dispose(); // closes this item's comm
    super.dispose();
  }

  private _render(): void {
    const state = this._model.connection === 'connected' ? this._model.state : null;
    this.setHidden(state === null);
    if (!state) {
      return;
    }
    const running = state.run !== null && !state.run.finished;
    const busy = state.inventory.gpus.filter(gpu => gpu.busy);
    const marks = [running ? 'running' : '', busy.length ? `${busy.map(gpu => gpu.index).join(',')} busy` : ''];
    this._label.textContent = [selectionLabel(state), ...marks.filter(Boolean)].join(' · ');
    this.node.dataset.running = String(running);
    this.node.dataset.busy = String(busy.length > 0);
    const why = busy.map(gpu => `GPU ${gpu.index}: ${gpu.busy}. `).join('');
    this.node.title = `Next launch: ${state.selection.magic_line}. ${why}Click to open the GPUs panel.`;
  }

  private _model: GpuPanelModel;
  private _icon = document.createElement('span');
  private _label = document.createElement('span');
}
