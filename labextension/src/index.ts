/**
 * accelnb's JupyterLab extension: the "GPUs" side panel and a toolbar item on each notebook.
 *
 * One plugin, `accelnb-labextension:gpu-panel`. The panel follows the active notebook; each notebook's
 * toolbar item shows that notebook's selection. Both talk to the kernel over the
 * `accelnb.gpus` comm (see `model.ts`, and `accelnb/notebook/lab_bridge.py` for the kernel side and
 * the protocol).
 */

import { ILayoutRestorer, JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { ICommandPalette, IToolbarWidgetRegistry } from '@jupyterlab/apputils';
import { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { ISettingRegistry } from '@jupyterlab/settingregistry';

import { GpuPanelModel } from './model';
import { GpuToolbarItem } from './toolbar';
import { GpuPanelView, gpuIcon } from './view';

const PANEL_ID = 'accelnb-gpu-panel';
const OPEN_COMMAND = 'accelnb:open-gpu-panel';
const TOOLBAR_ITEM = 'accelnb-gpus'; // as named in schema/gpu-panel.json (the plugin id's suffix)

function activateGpuPanel(
  app: JupyterFrontEnd,
  notebooks: INotebookTracker,
  restorer: ILayoutRestorer | null,
  palette: ICommandPalette | null,
  toolbars: IToolbarWidgetRegistry | null,
  settings: ISettingRegistry | null
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

  // The notebook toolbar is built from settings (this plugin's schema names the item), so
  // users can move or hide it like any other toolbar item.
  if (toolbars) {
    toolbars.addFactory<NotebookPanel>(
      'Notebook',
      TOOLBAR_ITEM,
      panel => new GpuToolbarItem(panel.sessionContext, () => void app.commands.execute(OPEN_COMMAND))
    );
  }
  if (settings) {
    // Loading our schema is what makes the toolbars see the item it declares.
    void settings.load(gpuPanelPlugin.id);
  }

  app.commands.addCommand(OPEN_COMMAND, {
    label: 'Show the GPUs panel',
    execute: () => app.shell.activateById(PANEL_ID)
  });
  if (palette) {
    palette.addItem({ command: OPEN_COMMAND, category: 'accelnb' });
  }
}

const gpuPanelPlugin: JupyterFrontEndPlugin<void> = {
  id: 'accelnb-labextension:gpu-panel',
  description: 'A side panel to choose the GPUs of the next accelnb launch and follow its ranks.',
  autoStart: true,
  requires: [INotebookTracker],
  optional: [ILayoutRestorer, ICommandPalette, IToolbarWidgetRegistry, ISettingRegistry],
  activate: activateGpuPanel
};

export default [gpuPanelPlugin];
