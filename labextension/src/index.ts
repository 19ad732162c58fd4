/**
 * accelnb's JupyterLab extension: the "GPUs" side panel.
 *
 * One plugin, `accelnb:gpu-panel`. The panel follows the active notebook and talks to its
 * kernel over the `accelnb.gpus` comm (see `model.ts`, and `accelnb/lab_bridge.py` for the
 * kernel side and the protocol).
 */

import { ILayoutRestorer, JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { ICommandPalette } from '@jupyterlab/apputils';
import { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';

import { GpuPanelModel } from './model';
import { GpuPanelView, gpuIcon } from './view';

const PANEL_ID = 'accelnb-gpu-panel';
const OPEN_COMMAND = 'accelnb:open-gpu-panel';

function activateGpuPanel(
  app: JupyterFrontEnd,
  notebooks: INotebookTracker,
  restorer: ILayoutRestorer | null,
  palette: ICommandPalette | null
): void {
  const model = new GpuPanelModel();
  const view = new GpuPanelView(model);
  view.id = PANEL_ID;
  view.title.icon = gpuIcon;
  view.title.caption = 'GPUs';
  app.shell.add(view, 'left', { rank: 600 });
  if (restorer) {
    restorer.add(view, PANEL_ID);
  }

  const follow = (panel: NotebookPanel | null) => model.setSession(panel ? panel.sessionContext : null);
  notebooks.currentChanged.connect((_, panel) => follow(panel));
  follow(notebooks.currentWidget);

  app.commands.addCommand(OPEN_COMMAND, {
    label: 'Show the GPUs panel',
    execute: () => app.shell.activateById(PANEL_ID)
  });
  if (palette) {
    palette.addItem({ command: OPEN_COMMAND, category: 'accelnb' });
  }
}

const gpuPanelPlugin: JupyterFrontEndPlugin<void> = {
  id: 'accelnb:gpu-panel',
  description: 'A side panel to choose the GPUs of the next accelnb launch and follow its ranks.',
  autoStart: true,
  requires: [INotebookTracker],
  optional: [ILayoutRestorer, ICommandPalette],
  activate: activateGpuPanel
};

export default [gpuPanelPlugin];
