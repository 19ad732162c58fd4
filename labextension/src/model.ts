/**
 * The panel's model: talks to one notebook's kernel over the `accelnb.gpus` comm.
 *
 * It follows a session context (the current notebook's), finds out whether accelnb is loaded
 * in its kernel, opens the comm when it is, and keeps the latest state the kernel sent. The
 * view only reads `connection`, `state`, `error`, `stacks` and `stacksPending`, and calls `select`,
 * `refresh`, `stop`, `requestStacks`.
 *
 * Finding out whether accelnb is loaded: opening a comm to a target the kernel does not know
 * makes ipykernel log an error and close it, so instead of trying blindly after every cell we
 * ask first with a silent `user_expressions` probe (no output, no execution count, no
 * `execute_input`). We probe when a kernel is attached or restarted, and after every cell the
 * user runs (seen as `execute_input` on IOPub, then the next `idle`), so running
 * `%load_ext accelnb` fills the panel without a reload.
 */

import { ISessionContext } from '@jupyterlab/apputils';
import { Kernel, KernelMessage as KM } from '@jupyterlab/services';
import { ISignal, Signal } from '@lumino/signaling';

import { COMM_TARGET, IStacksMessage, IStateMessage, KernelMessage, PanelMessage } from './protocol';

/** Where the panel stands with the current notebook. */
export type Connection =
  | 'no-notebook' // no notebook is active
  | 'no-kernel' // the notebook has no running kernel
  | 'checking' // waiting for the kernel to answer whether accelnb is loaded
  | 'not-loaded' // the kernel runs, accelnb is not loaded in it
  | 'connected'; // the comm is open; `state` is the kernel's latest

// A Python expression, evaluated silently in the kernel: is the comm target registered?
const PROBE_EXPRESSION =
  "__import__('sys').modules['accelnb.notebook.lab_bridge'].is_registered() " +
  "if 'accelnb.notebook.lab_bridge' in __import__('sys').modules else False";

export class GpuPanelModel {
  /** Emitted whenever `connection`, `state` or `error` changes. */
  get changed(): ISignal<this, void> {
    return this._changed;
  }

  get connection(): Connection {
    return this._connection;
  }

  /** The latest full state from the kernel (kept while reconnecting, null before the first). */
  get state(): IStateMessage | null {
    return this._state;
  }

  /** The last error the kernel reported for a request of this panel, cleared by the next state. */
  get error(): string {
    return this._error;
  }

  /** The last stacks the kernel sent (null before the first request, and for a new kernel). */
  get stacks(): IStacksMessage | null {
    return this._stacks;
  }

  /** A stacks request is on its way: the kernel answers within about a second. */
  get stacksPending(): boolean {
    return this._stacksPending;
  }

  /** The name of the followed notebook, for the panel's header. */
  get notebookName(): string {
    return this._session?.name ?? '';
  }

  /** Follow another notebook's session (or none). */
  setSession(session: ISessionContext | null): void {
    if (session === this._session) {
      return;
    }
    if (this._session) {
      this._session.kernelChanged.disconnect(this._onKernelChanged, this);
      this._session.statusChanged.disconnect(this._onStatus, this);
      this._session.iopubMessage.disconnect(this._onIopub, this);
    }
    this._closeComm();
    this._state = null;
    this._error = '';
    this._stacks = null;
    this._stacksPending = false;
    this._session = session;
    if (session) {
      session.kernelChanged.connect(this._onKernelChanged, this);
      session.statusChanged.connect(this._onStatus, this);
      session.iopubMessage.connect(this._onIopub, this);
    }
    this._attach();
  }

  /** Make these GPUs (nvidia-smi indices) the default of the next launches; [] clears. */
  select(gpus: number[]): void {
    this._send({ type: 'select', gpus: [...gpus].sort((a, b) => a - b) });
  }

  /** Make `count` CPU ranks the default of the next launches. */
  selectProcesses(count: number): void {
    this._send({ type: 'select', num_processes: count });
  }

  /**
   * While the panel is shown, have the kernel read the GPUs every 2 s (their utilisation history);
   * kept across reconnections, so a restarted kernel is asked again.
   */
  watch(on: boolean): void {
    if (on === this._watching) {
      return;
    }
    this._watching = on;
    if (this._comm && !this._comm.isDisposed) {
      this._send({ type: 'watch', on });
    }
  }

  /** Ask the kernel to read the GPUs again (memory, utilisation). */
  refresh(): void {
    this._send({ type: 'refresh' });
  }

  /**
   * Stop the run in progress.
   *
   * A launch that blocks its cell also blocks the kernel's message loop, so a comm message
   * would wait until the run ends by itself. An interrupt reaches the kernel at once, and
   * accelnb's launcher turns it into stopping every worker. The comm message covers runs that
   * do not block (the kernel is idle then, and an interrupt would do nothing).
   */
  async stop(): Promise<void> {
    this._send({ type: 'stop' });
    const kernel = this._session?.session?.kernel;
    if (kernel && kernel.status === 'busy') {
      await kernel.interrupt();
    }
  }

  /**
   * Ask for every rank's current Python stack. Nothing stops: the kernel reads the stacks while
   * the launch cell keeps running (comm messages get through a launch's wait loop while a panel
   * is connected), and answers with a `stacks` message.
   */
  requestStacks(): void {
    if (!this._comm || this._comm.isDisposed) {
      this._send({ type: 'stacks' }); // says why it cannot
      return;
    }
    this._stacksPending = true;
    this._changed.emit();
    this._send({ type: 'stacks' });
  }

  dispose(): void {
    this.setSession(null);
    Signal.clearData(this);
  }

  private _attach(): void {
    this._closeComm();
    const session = this._session;
    if (!session) {
      this._setConnection('no-notebook');
      return;
    }
    this._probeWanted = true;
    const kernel = session.session?.kernel;
    if (!kernel) {
      this._setConnection('no-kernel');
      // A kernel may still be on its way: `kernelChanged` will call us again.
      return;
    }
    this._setConnection('checking');
    if (kernel.status === 'idle') {
      void this._probe();
    }
  }

  private _onKernelChanged(): void {
    this._state = null;
    this._attach();
  }

  private _onStatus(_: ISessionContext, status: Kernel.Status): void {
    if (status === 'restarting' || status === 'autorestarting' || status === 'dead') {
      // The kernel's comms died with it; a restarted kernel has not loaded accelnb.
      this._comm = null;
      this._state = null;
      this._probeWanted = true;
      this._setConnection(status === 'dead' ? 'no-kernel' : 'checking');
    } else if (status === 'idle' && this._probeWanted && !this._comm) {
      void this._probe();
    }
  }

  private _onIopub(_: ISessionContext, msg: KM.IMessage): void {
    // A cell the user ran may have loaded accelnb: check again once the kernel is idle.
    if (msg.header.msg_type === 'execute_input' && !this._comm) {
      this._probeWanted = true;
    }
  }

  private async _probe(): Promise<void> {
    const session = this._session;
    const kernel = session?.session?.kernel;
    if (!kernel || this._probing) {
      return;
    }
    this._probeWanted = false;
    this._probing = true;
    let loaded = false;
    try {
      const reply = await kernel.requestExecute(
        {
          code: '',
          silent: true,
          store_history: false,
          user_expressions: { accelnb: PROBE_EXPRESSION }
        },
        true
      ).done;
      const content = reply.content as KM.IExecuteReply;
      const result = content.status === 'ok' ? content.user_expressions['accelnb'] : undefined;
      const data = (result as { data?: Record<string, string> } | undefined)?.data;
      loaded = data?.['text/plain'] === 'True';
    } catch (reason) {
      // The kernel went away or is not a Python kernel: same as not loaded.
      loaded = false;
    } finally {
      this._probing = false;
    }
    if (session !== this._session || kernel !== session.session?.kernel || this._comm) {
      return; // the panel moved on while we waited
    }
    if (loaded) {
      this._openComm(kernel);
    } else {
      this._setConnection('not-loaded');
    }
  }

  private _openComm(kernel: Kernel.IKernelConnection): void {
    const comm = kernel.createComm(COMM_TARGET);
    this._comm = comm;
    comm.onMsg = (msg: KM.ICommMsgMsg) => {
      if (comm !== this._comm) {
        return;
      }
      const data = msg.content.data as unknown as KernelMessage;
      if (data.type === 'state') {
        this._state = data;
        this._error = '';
        this._setConnection('connected', true);
      } else if (data.type === 'error') {
        this._error = data.message;
        this._changed.emit();
      } else if (data.type === 'stacks') {
        this._stacks = data;
        this._stacksPending = false;
        this._changed.emit();
      }
    };
    comm.onClose = () => {
      if (comm !== this._comm) {
        return; // we closed it ourselves
      }
      // The kernel closed it: accelnb was unloaded or failed to answer.
      this._comm = null;
      this._probeWanted = true;
      this._setConnection('not-loaded');
    };
    // The kernel answers the open with a full state message.
    comm.open({});
    if (this._watching) {
      this._send({ type: 'watch', on: true });
    }
  }

  private _closeComm(): void {
    const comm = this._comm;
    this._comm = null;
    if (comm && !comm.isDisposed) {
      try {
        comm.close(); // lets the kernel unsubscribe this panel
      } catch (reason) {
        // The kernel connection is already gone: nothing to tell it.
      }
    }
  }

  private _send(message: PanelMessage): void {
    if (!this._comm || this._comm.isDisposed) {
      this._error = 'Not connected to the kernel: run `%load_ext accelnb` in the notebook.';
      this._changed.emit();
      return;
    }
    this._comm.send(message as unknown as KM.ICommMsgMsg['content']['data']);
  }

  private _setConnection(connection: Connection, force = false): void {
    if (connection !== this._connection || force) {
      this._connection = connection;
      this._changed.emit();
    }
  }

  private _session: ISessionContext | null = null;
  private _comm: Kernel.IComm | null = null;
  private _connection: Connection = 'no-notebook';
  private _state: IStateMessage | null = null;
  private _error = '';
  private _stacks: IStacksMessage | null = null;
  private _stacksPending = false;
  private _probeWanted = false;
  private _probing = false;
  private _watching = false;
  private _changed = new Signal<this, void>(this);
}
